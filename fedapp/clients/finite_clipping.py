"""Per-sample clipping that a non-finite per-sample gradient cannot bypass (DP-SGD, Abadi et al. 2016, Alg. 1).

Opacus' flat clipping scales g_i by min(1, c/(‖g_i‖ + 1e-6)): NaN for a NaN norm, and 0·∞ = NaN for an infinite one,
so one record whose gradient overflows makes the step's whole clipped sum NaN, a failure that depends on whether that
record was sampled. Here a per-sample gradient whose norm is not finite counts as 0 (a clipped contribution of norm
0 ≤ c), so every step is a sum of vectors of norm ≤ c plus N(0, c²z²): the subsampled Gaussian mechanism the
accountant composes. The cost is one ``isfinite`` on the per-sample norms and a write of the non-finite rows only
(a CPU) or a fill without a host sync (a GPU, so a CUDA graph captures it); the ``hooks``, ``ew`` and ``functorch``
modes all clip here.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch


def finite_clip_factors(norms: torch.Tensor, clip: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min(1, c/(‖g_i‖ + 1e-6)) with 0 where ‖g_i‖ is not finite, the rows to zero for :func:`zero_rows_`): Opacus'
    factor, 1e-6 included, that no NaN or ∞ reaches. The rows are a mask on a GPU (no host sync, so a CUDA graph
    captures it) and their indices on a CPU (found on the host, so only those rows are written). On a CPU one read
    of Σ_i ‖g_i‖ decides first whether there are any: a float sum is finite only if every term is, so a finite sum
    takes Opacus' factor for every row and no rows, a dozen fewer small operations a step."""
    factor = clip / (norms + 1e-6)
    if not norms.is_cuda and math.isfinite(float(norms.sum())):
        return factor.clamp(max=1.0), torch.empty(0, dtype=torch.long, device=norms.device)
    finite = torch.isfinite(norms)
    factor = torch.where(finite, factor, torch.zeros((), dtype=norms.dtype, device=norms.device))
    rows = ~finite if norms.is_cuda else (~finite).reshape(-1).nonzero().reshape(-1)
    return factor.clamp(max=1.0), rows


def zero_rows_(grad_sample: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``grad_sample`` [B, ...] with ``rows`` (a mask [B] or indices) set to 0 in place, so 0·∞ never enters a sum.
    A mask is a fill over the whole tensor (cheap at a GPU's bandwidth); indices write only those rows (on a CPU a
    full pass would double the clip step's memory traffic)."""
    if rows.dtype == torch.bool:
        return grad_sample.masked_fill_(rows.to(grad_sample.device).view(-1, *([1] * (grad_sample.dim() - 1))), 0.0)
    return grad_sample.index_fill_(0, rows.to(grad_sample.device), 0.0)


@functools.cache
def finite_clip_dp_optimizer() -> Any:
    """``FiniteClipDPOptimizer``: Opacus' ``DPOptimizer`` (flat clipping, not distributed) whose clip step zeroes
    non-finite per-sample gradients (:func:`finite_clip_factors`); noise, scaling and the wrapped step are Opacus'
    own. Built on first use: importing Opacus costs seconds, and the batched path needs only the functions above."""
    from opacus.optimizers import DPOptimizer
    from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

    class FiniteClipDPOptimizer(DPOptimizer):
        def clip_and_accumulate(self) -> None:
            grad_samples = self.grad_samples
            if len(grad_samples[0]) == 0:  # empty Poisson batch: Opacus' zero-length clip (noise only)
                super().clip_and_accumulate()
                return
            device = grad_samples[0].device
            norms = torch.stack([g.reshape(len(g), -1).norm(2, dim=-1).to(device) for g in grad_samples], 1).norm(2, 1)
            factor, rows = finite_clip_factors(norms, self.max_grad_norm)
            for p in self.params:
                _check_processed_flag(p.grad_sample)
                grad_sample = zero_rows_(self._get_flat_grad_sample(p).to(p.dtype), rows)
                grad = torch.einsum("i,i...", factor.to(grad_sample.device, p.dtype), grad_sample)
                if p.summed_grad is not None:
                    p.summed_grad += grad
                else:
                    p.summed_grad = grad
                _mark_as_processed(p.grad_sample)

    return FiniteClipDPOptimizer
