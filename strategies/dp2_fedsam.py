"""DP2-FedSAM (Zhang et al., "Differentially Private and Personalized FL with SAM", Algorithm 2) and baselines.

What it protects: **client-level DP** — the participation and whole dataset of one client — for the
*shared* part of the model that leaves the client. Each sampled client clips its update Δφ to
‖Δ‖ ≤ C and adds Gaussian noise itself (local noising, honest-but-curious server, Sec. 3.1), via the
shared :class:`strategies.privacy.mechanisms.ClientLevelDP`. The personal head h_i never leaves the client
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

Adaptive clipping (``adaptive-clip-quantile`` > 0, every variant; Andrew et al., NeurIPS 2021, Alg. 1 / Thm 1):
the machinery of :class:`~strategies.client_level.ClientLevelDPStrategy` (C_t in the fit config, the noise split
z_Δ/σ_b charged at z, the count as a metric or, under SecAgg+ with continuous Gaussian shares, as coordinate d_φ+1
of the secure sum). The vector clipped at C_t and noised is the shared-part update Δφ (the whole model's update for
the non-personalized variants), so each client's bit is b_i = 1[‖Δφ_i‖ ≤ C_t]: the head's update never leaves the
client and is neither clipped nor counted.

Framework-free math (numpy/torch only): φ/h split by parameter-name prefix
(:func:`head_parameter_names`) and the SAM/ASAM step of Eq. 11–12 (:func:`sam_gradient`); the local
training loop that uses them is ``fedapp.clients.training``. The Flower server strategy aggregates only φ
(personalized variants) or the whole model (DP-FedSAM, FT variants) with uniform weights 1/r.

Variants (Sec. 5): ``dp2-fedsam`` (head SGD τ_h epochs then SAM on φ τ_φ epochs), ``centaur``
(same with SGD instead of SAM), ``dp-fedsam`` (full model, SAM), ``dp-fedsam-ft`` and
``dp-fedavg-ft`` (full model, SAM / SGD, plus local fine-tuning before evaluation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from strategies.base import ClientUpdate
from strategies.client_level import ClientLevelDPStrategy
from strategies.privacy import threat_models


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
def _total(terms: Iterable[torch.Tensor]) -> torch.Tensor:
    """Python's left-to-right ``sum`` of 0-d tensors (a tensor, never the start value 0)."""
    total = sum(terms)
    if not isinstance(total, torch.Tensor):
        raise ValueError("SAM needs at least one parameter")
    return total


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
            norm = torch.sqrt(_total(((s * g) ** 2).sum() for s, g in zip(scale, grads)))
            eps = [rho * s * s * g / (norm + 1e-12) for s, g in zip(scale, grads)]
        else:
            norm = torch.sqrt(_total((g**2).sum() for g in grads))
            eps = [rho * g / (norm + 1e-12) for g in grads]
        for p, e in zip(params, eps):
            p.add_(e)
    closure()
    with torch.no_grad():
        for p, e in zip(params, eps):
            p.sub_(e)
    return loss


# ---------------------------------------------------------------------------------- server
class DP2FedSAMStrategy(ClientLevelDPStrategy):
    """Server of the family: holds the shared part only, φ ← φ + (1/r) Σ Δ̂_i (Alg. 2 line 25)."""

    privacy = threat_models.CLIENT_LEVEL_PERSONALIZED

    def __init__(self, *, name: str, eval_every: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.name = name
        self.variant = get_variant(name)
        self.eval_every = max(1, int(eval_every))

    def aggregation_weights(self, server_round: int, updates: list[ClientUpdate]) -> tuple[np.ndarray, dict[str, Any]]:
        extra: dict[str, Any] = {}
        if self.dp is not None and self.adaptive is None:  # adaptive: ServerClip.adapt reports the round's C_t
            extra["clip_norm"] = self.dp.clip

        def clip_of(u: ClientUpdate) -> float:  # the clip it was clipped at (adaptive: the C_t checked on acceptance)
            if self.dp is None:
                return math.inf
            return float(u.metrics["clip_norm"]) if self.adaptive is not None else self.dp.clip

        reported = [u for u in updates if "local_update_norm" in u.metrics]
        norms = [float(u.metrics["local_update_norm"]) for u in reported]
        if norms:  # Figure 5 diagnostic, only present when clients opt in (dp2-report-norms)
            extra.update(mean_local_update_norm=float(np.mean(norms)), std_local_update_norm=float(np.std(norms)),
                         clipped_fraction=float(np.mean([n > clip_of(u) for n, u in zip(norms, reported)])))
        return np.ones(len(updates)), extra  # uniform 1/r (Alg. 1 line 13, Alg. 2 line 25)

    def evaluates(self, server_round: int) -> bool:
        """Every ``eval_every`` rounds (run-wide count) and after the last."""
        return (server_round % self.eval_every == 0 or server_round == self.num_rounds) and super().evaluates(server_round)
