"""Many clients' DP-SGD in one batched step (``torch.func``): the multi-client path.

Clients that share a model architecture train in lockstep. Their parameters are stacked ``[K, ...]``;
per-sample gradients come from ``vmap`` over clients of ``vmap`` over samples of ``grad(ℓ)``; each client
keeps its own Poisson batch (rate q_k = 1/⌈N_k/b_k⌉), clip C_k (Abadi et al. 2016, Alg. 1:
ḡ = g · min(1, C/‖g‖)), Gaussian noise N(0, σ_k² C_k²), step size and momentum.

Each client's randomness is its own ``torch.Generator`` drawn in Opacus' order — the Poisson mask
(``torch.rand(N_k) < q_k``), then one normal draw per parameter in registration order — and its noisy sum
is divided by Opacus' expected batch size ``int(N_k q_k)`` (the one draw a ``DataLoader`` iterator takes for
its base seed at each epoch's start is kept too). A client therefore trains exactly as Opacus'
``DPDataLoader`` + ``DPOptimizer`` would with that generator (tests/unit/fedapp/clients/test_batched_dpsgd.py compares
both paths step by step), so its guarantee and accounting are unchanged: record-level (ε_k, δ_k)-DP of client
k's data, q_k and T_k steps composed by the RDP accountant as for the per-client path. Batching changes
only where the arithmetic runs, not what any client releases.

On a GPU, give each client a CUDA generator (``torch.Generator(device="cuda")``): its draws then stay on the
device (Opacus' sampler draws on the CPU only, so that run is not bit-comparable with Opacus; the mechanism is
the same). Limits: models without buffers or a data-independent regularizer (BatchNorm is not DP-SGD compatible
anyway); one loss (cross-entropy); every client starts from the same weights (a round's global model).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from fedapp.clients.finite_clipping import finite_clip_factors, zero_rows_
from fedapp.data.datasets import ArrayDataset
from fedapp.privacy.profiles import dpsgd_sample_rate, steps_per_epoch


@dataclass
class BatchedClient:
    """One client's local DP-SGD job: data, batch size b_k, steps (rounded up to whole epochs), η_k, σ_k, C_k."""

    data: ArrayDataset
    batch_size: int
    steps: int
    lr: float
    noise_multiplier: float
    clip: float
    generator: torch.Generator
    momentum: float = 0.0

    @property
    def sample_rate(self) -> float:
        return dpsgd_sample_rate(len(self.data), self.batch_size)

    @property
    def total_steps(self) -> int:
        """Poisson steps taken: ``steps`` rounded up to whole epochs of ⌈N/b⌉ (as ``local_train``)."""
        per_epoch = steps_per_epoch(len(self.data), self.batch_size)
        return -(-self.steps // per_epoch) * per_epoch

    @property
    def expected_batch_size(self) -> int:
        return int(len(self.data) * self.sample_rate)  # Opacus' divisor for loss_reduction = "mean"


def _per_sample_grads(model: nn.Module):
    """``(params[K,...], x[K,B,...], y[K,B]) -> grads[K,B,...]``: per-sample gradients of every client."""

    def sample_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, params, (x.unsqueeze(0),)), y.unsqueeze(0))

    return vmap(vmap(grad(sample_loss), in_dims=(None, 0, 0)), in_dims=(0, 0, 0))


def clipped_sums(per_sample: dict[str, torch.Tensor], mask: torch.Tensor, clip: torch.Tensor) -> dict[str, torch.Tensor]:
    """Σ_b mask_kb · min(1, C_k / (‖g_kb‖ + 1e-6)) · g_kb per client (Opacus' flat clipping, its 1e-6 included); a
    g_kb whose norm is not finite counts as 0, sampled or padding (:mod:`fedapp.clients.finite_clipping`)."""
    sq = functools.reduce(operator.add, (g.flatten(2).pow(2).sum(-1) for g in per_sample.values()))
    factor, rows = finite_clip_factors(sq.sqrt(), clip[:, None])
    factor = factor * mask
    return {n: torch.einsum("kb,kb...->k...", factor, zero_rows_(g.flatten(0, 1), rows.reshape(-1)).view_as(g))
            for n, g in per_sample.items()}


def train_clients_batched(model: nn.Module, clients: list[BatchedClient],
                          device: torch.device | None = None) -> list[dict[str, torch.Tensor]]:
    """Run every client's local DP-SGD from ``model``'s current weights; returns each client's final weights.

    Clients with fewer steps drop out of the batch when they are done; a step batches the active clients,
    padding their Poisson batches to the largest one (padded rows have mask 0, so they add nothing).
    """
    device = device or torch.device("cpu")
    if list(model.buffers()) or callable(getattr(model, "regularization", None)):
        raise ValueError("the batched path supports models without buffers or a regularizer")
    model = model.to(device)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    k_all = len(clients)
    start = {n: p.detach() for n, p in model.named_parameters() if n in names}
    params = {n: p.unsqueeze(0).repeat(k_all, *([1] * p.dim())).clone() for n, p in start.items()}
    bufs = {n: torch.zeros_like(p) for n, p in params.items()}
    data = [(torch.from_numpy(c.data.x).to(device), torch.from_numpy(c.data.y).to(device)) for c in clients]
    lr = torch.tensor([c.lr for c in clients], device=device)
    mom = torch.tensor([c.momentum for c in clients], device=device)
    clip = torch.tensor([c.clip for c in clients], device=device)
    per_sample = _per_sample_grads(model)
    totals = [c.total_steps for c in clients]
    per_epoch = [steps_per_epoch(len(c.data), c.batch_size) for c in clients]
    for t in range(max(totals, default=0)):
        active = [k for k in range(k_all) if t < totals[k]]
        for k in active:  # a DataLoader iterator draws its base seed at every epoch's start: keep that draw
            if t % per_epoch[k] == 0:
                g = clients[k].generator
                torch.empty((), dtype=torch.int64, device=g.device).random_(generator=g)
        idx = [torch.rand(len(clients[k].data), generator=clients[k].generator, device=clients[k].generator.device)
               < clients[k].sample_rate for k in active]  # Opacus' UniformWithReplacementSampler draw, per client
        rows = [m.nonzero().reshape(-1).to(device) for m in idx]
        width = max(1, max(len(r) for r in rows))
        gather = torch.zeros(len(active), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(active), width, device=device)
        for j, r in enumerate(rows):
            gather[j, :len(r)], mask[j, :len(r)] = r, 1.0
        x = torch.stack([data[k][0][gather[j]] for j, k in enumerate(active)])
        y = torch.stack([data[k][1][gather[j]] for j, k in enumerate(active)])
        act = torch.tensor(active, device=device)
        sub = {n: p[act] for n, p in params.items()}
        with torch.no_grad():
            sums = clipped_sums(per_sample(sub, x, y), mask, clip[act])
            for j, k in enumerate(active):
                c = clients[k]
                std = c.noise_multiplier * c.clip
                for n in names:  # DPOptimizer.add_noise order: one draw per parameter, registration order
                    if std > 0:
                        sums[n][j] += torch.normal(0.0, std, size=tuple(sums[n][j].shape), generator=c.generator,
                                                   device=c.generator.device).to(device)
                    sums[n][j] /= c.expected_batch_size
            for n in names:  # torch.optim.SGD: buf = μ·buf + g (buf starts at 0, so g at the first step); p -= η·buf
                view = (-1, *([1] * (sums[n].dim() - 1)))
                bufs[n][act] = mom[act].view(view) * bufs[n][act] + sums[n]
                params[n][act] = sub[n] - lr[act].view(view) * bufs[n][act]
    return [{n: params[n][k].clone() for n in names} for k in range(k_all)]
