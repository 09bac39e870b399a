"""finite_clip_factors: Opacus' factor min(1, c/(‖g_i‖ + 1e-6)) with non-finite norms at 0, on both of its CPU paths."""

from __future__ import annotations

import math

import torch

from fedapp.clients.finite_clipping import finite_clip_factors, zero_rows_


def _opacus(norms: torch.Tensor, clip: float) -> torch.Tensor:
    """Opacus' flat-clipping factor, with 0 where the norm is not finite."""
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)
    return torch.where(torch.isfinite(norms), factor, torch.zeros(()))


def test_finite_norms_take_opacus_factor_and_no_rows():
    norms = torch.tensor([0.0, 0.3, 1.0, 7.5, 1e30])
    factor, rows = finite_clip_factors(norms, 1.0)
    assert torch.equal(factor, _opacus(norms, 1.0)) and len(rows) == 0


def test_non_finite_norms_get_factor_zero_and_their_rows_are_zeroed():
    norms = torch.tensor([0.5, math.nan, 2.0, math.inf])
    factor, rows = finite_clip_factors(norms, 1.0)
    assert torch.equal(factor, _opacus(norms, 1.0)) and rows.tolist() == [1, 3]
    grads = torch.ones(4, 3)
    assert zero_rows_(grads, rows).sum(1).tolist() == [3.0, 0.0, 3.0, 0.0]


def test_finite_norms_whose_sum_overflows_still_get_their_factors():
    norms = torch.tensor([3e38, 3e38, 0.5])  # each finite in float32, their sum is not
    assert not math.isfinite(float(norms.sum()))
    factor, rows = finite_clip_factors(norms, 1.0)
    assert torch.equal(factor, _opacus(norms, 1.0)) and len(rows) == 0
