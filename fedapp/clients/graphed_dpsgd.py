"""DP-SGD with each step replayed as one CUDA graph (``cuda-graphs = true``).

A DP-SGD step of a small model on a GPU costs its kernel launches and Opacus' Python, not arithmetic: the
MNIST CNN's step takes ~4.7 ms on an H200 for well under a millisecond of compute (docs/benchmarks.md, GPU).
Here the whole step (Opacus ``hooks`` forward and backward, per-sample clipping, noise, the SGD update) is
captured once per local training and replayed, so a step costs a graph launch and three copies (a 20-client
MNIST cohort, one client after another on an H100: 8.63 s step by step, 1.40 s replayed; docs/benchmarks.md).

A graph needs fixed shapes, and Poisson batches (Abadi et al. 2016, Alg. 1; what Opacus' ``DPDataLoader``
draws) vary in size. Every step of the local training is therefore drawn up front, exactly as
:func:`fedapp.clients.training._poisson_batches` draws it (per epoch the loader's base-seed draw, per step
``rand(N) < q`` on the data's device), and each batch is padded to P rows, P the largest batch of the
training rounded up to a multiple of :data:`PAD_MULTIPLE`. A padded row carries weight 0 in the loss
``Σ_i m_i·ℓ_i / P``, which Opacus' ``mean`` reduction scales back by P: a real row's per-sample gradient is
∇ℓ_i, a padded row's is 0, so its norm is 0, its clipped gradient is 0, and the step's clipped sum, noise
N(0, σ²c²) and division by the expected batch size are the unpadded step's. Privacy is unchanged: the same
records in the same batches, the same clipping and noise, the same q and step count for the accountant.
An empty batch is a noise-only step, as in the unpadded loop.

On a CPU the same padded steps run eagerly, without a graph (what the tests compare with the unpadded loop).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

PAD_MULTIPLE = 8  # batches padded to a multiple of this: a few graph shapes, little wasted work
WARMUP_STEPS = 2  # eager steps on a side stream before capture (cuBLAS/cuDNN set-up), then undone


def padded_poisson_epochs(x: torch.Tensor, y: torch.Tensor, sample_rate: float, per_epoch: int,
                          epochs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(X, Y, M, counts): ``epochs·per_epoch`` Poisson batches of ``_poisson_batches`` (same draws, same order),
    padded to P rows. X is [steps, P, ...], Y [steps, P], M [steps, P] (1 for a real row, 0 for padding, in
    x's dtype), counts [steps]. Each batch's real rows come first, in increasing record order as ``nonzero``
    gives them."""
    n = len(y)
    keep: list[torch.Tensor] = []
    for _ in range(epochs):
        torch.empty((), dtype=torch.int64).random_()  # the DataLoader iterator's base-seed draw
        keep.extend(torch.rand(n, device=x.device) < sample_rate for _ in range(per_epoch))
    chosen = torch.stack(keep)
    counts = chosen.sum(1)
    pad = max(PAD_MULTIPLE, -(-int(counts.max()) // PAD_MULTIPLE) * PAD_MULTIPLE)  # one sync per training
    pad = min(pad, max(n, 1))
    # chosen rows first (stable: increasing record index), then unchosen ones as padding
    order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)[:, :pad]
    mask = (torch.arange(pad, device=x.device)[None, :] < counts[:, None]).to(x.dtype)
    return x[order], y[order], mask, counts


class GraphedSteps:
    """One local training's padded DP-SGD steps on an Opacus-wrapped ``module`` and its ``optimizer``:
    captured as a CUDA graph on a GPU (after :data:`WARMUP_STEPS` eager steps that are undone), eager on a CPU.

    ``params`` are the trained parameters (restored after the warm-up), ``buffers`` the optimizer's momentum
    buffers, pre-allocated so that the captured update accumulates into them (zeroed after the warm-up).
    """

    def __init__(self, module: nn.Module, optimizer, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
                 example: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self.module, self.optimizer = module, optimizer
        xb, yb, mb = example
        self.xb, self.yb, self.mb = xb.clone(), yb.clone(), mb.clone()
        self.loss: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        if self.xb.device.type == "cuda":
            self._capture(params, buffers)

    def _step(self) -> torch.Tensor:
        """One padded DP-SGD step on the static batch; returns the mean loss over the real rows."""
        self.optimizer.zero_grad(set_to_none=True)
        losses = nn.functional.cross_entropy(self.module(self.xb), self.yb, reduction="none") * self.mb
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook")
            losses.sum().div(self.mb.numel()).backward()  # 'mean' over P: Opacus scales per-sample grads by P
        self.optimizer.step()
        return losses.detach().sum() / self.mb.sum().clamp(min=1.0)

    def _capture(self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
        saved = [p.detach().clone() for p in params]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.loss = self._step()
        with torch.no_grad():  # the warm-up steps trained: undo them
            for p, s in zip(params, saved):
                p.copy_(s)
            for b in buffers:
                b.zero_()
        self.graph = graph

    def run(self, xb: torch.Tensor, yb: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
        """One step on (xb, yb, mb); the returned loss is overwritten by the next step on a GPU."""
        self.xb.copy_(xb)
        self.yb.copy_(yb)
        self.mb.copy_(mb)
        if self.graph is None:
            return self._step()
        self.graph.replay()
        assert self.loss is not None
        return self.loss


def run_padded(module: nn.Module, optimizer, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
               x: torch.Tensor, y: torch.Tensor, sample_rate: float, per_epoch: int, epochs: int,
               after_step: Callable[[], None] | None = None) -> tuple[int, float]:
    """Run every padded Poisson step of the training; returns (steps, mean of the steps' losses).

    ``buffers`` are the optimizer's momentum buffers, already allocated as zeros (``PlainSGD.zero_momentum``), so
    the captured update accumulates into them and its first step (b ← μ·0 + g = g) is PlainSGD's first step.
    """
    xs, ys, ms, _ = padded_poisson_epochs(x, y, sample_rate, per_epoch, epochs)
    steps = GraphedSteps(module, optimizer, params, buffers, (xs[0], ys[0], ms[0]))
    total = torch.zeros((), device=x.device)
    for t in range(len(ys)):
        total += steps.run(xs[t], ys[t], ms[t])
        if after_step is not None:
            after_step()
    return len(ys), float(total) / max(len(ys), 1)
