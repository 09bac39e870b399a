"""The batched multi-client DP-SGD step equals the per-client Opacus path (fedapp.clients.training.local_train)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fedapp.clients.batched_dpsgd import BatchedClient, clipped_sums, train_clients_batched
from fedapp.clients.training import LocalTraining, PerSampleDP, local_train
from fedapp.data.datasets import ArrayDataset
from fedapp.models.zoo import build_model


def _client_data(n: int, seed: int, shape=(1, 8, 8)) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    return ArrayDataset(rng.normal(size=(n, *shape)).astype(np.float32), rng.integers(0, 10, n).astype(np.int64), 10)


def _model(shape=(1, 8, 8)) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("cnn-digits", shape, 10)


def test_clipped_sums_match_opacus_per_sample_clipping():
    from opacus import GradSampleModule

    model, data = _model(), _client_data(12, 1)
    gsm = GradSampleModule(copy.deepcopy(model))
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    torch.nn.functional.cross_entropy(gsm(x), y).backward()  # Opacus' default loss_reduction = "mean"
    ref = {}
    norms = torch.stack([p.grad_sample.flatten(1).norm(dim=1) for p in gsm.parameters()], 1).norm(dim=1)
    clip = float(norms.median())  # about half the samples clipped, half not
    assert (norms > clip).any() and (norms < clip).any()
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)
    for (n, p) in gsm._module.named_parameters():
        ref[n] = torch.einsum("i,i...", factor, p.grad_sample)
    from fedapp.clients.batched_dpsgd import _per_sample_grads

    params = {n: p.detach().unsqueeze(0).repeat(2, *([1] * p.dim())) for n, p in model.named_parameters()}
    per_sample = _per_sample_grads(model)(params, torch.stack([x, x]), torch.stack([y, y]))
    mask = torch.ones(2, 12)
    mask[1, 6:] = 0  # the second client's batch is the first 6 rows, padded to 12
    sums = clipped_sums(per_sample, mask, torch.tensor([clip, clip]))
    for n, r in ref.items():
        torch.testing.assert_close(sums[n][0], r, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(sums[n][1], torch.einsum("i,i...", factor[:6], per_sample[n][1, :6]),
                                   rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_batched_clients_train_exactly_as_the_per_client_opacus_path(momentum: float):
    """Same seeds -> same Poisson batches, clipped sums and noise: each client's weights after local DP-SGD
    (different N_k, b_k, σ_k, C_k, η_k; different step counts) equal local_train's with Opacus hooks."""
    model = _model()
    specs = [  # (N, b, steps, lr, sigma, clip, seed)
        (40, 8, 5, 0.10, 1.0, 1.0, 11),
        (25, 5, 7, 0.05, 0.7, 0.5, 12),
        (60, 16, 3, 0.20, 2.0, 2.0, 13),
    ]
    clients, expected = [], []
    for i, (n, b, steps, lr, sigma, clip, seed) in enumerate(specs):
        data = _client_data(n, 100 + i)
        ref = copy.deepcopy(model)
        result = local_train(ref, data, LocalTraining(batch_size=b, steps=steps, lr=lr, momentum=momentum, seed=seed,
                                                      dp=PerSampleDP(sigma, clip, "hooks")))
        expected.append((dict(ref.named_parameters()), result.steps))
        clients.append(BatchedClient(data, b, steps, lr, sigma, clip, torch.Generator().manual_seed(seed), momentum))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = train_clients_batched(model, clients)
    for k, (ref, steps) in enumerate(expected):
        assert clients[k].total_steps == steps
        for n, p in ref.items():
            torch.testing.assert_close(got[k][n], p.detach(), rtol=1e-5, atol=1e-6, msg=f"client {k} {n}")
            assert not torch.equal(got[k][n], before[n])
    for n, p in model.named_parameters():  # the shared starting model is left as it was
        assert torch.equal(p.detach(), before[n])


def test_float32_differences_are_rounding_at_kinks_not_the_mechanism():
    """Images with flat zero backgrounds (as MNIST) tie ReLU/max-pool inputs: in float32 a 1e-8 rounding
    difference can pick another subgradient there, so the paths may drift apart by more than rounding. In
    float64 the same clients agree to rounding: the mechanism (batches, clipping, noise) is the same."""
    torch.set_default_dtype(torch.float64)
    try:
        model = _model().double()
        clients, expected = [], []
        for i, (n, b, seed) in enumerate([(48, 8, 21), (30, 6, 22)]):
            d = _client_data(n, 200 + i)
            x = np.where(np.abs(d.x) < 1.0, 0.0, d.x)  # ~68 % exact zeros: ties everywhere
            data = ArrayDataset(x.astype(np.float64), d.y, 10)
            ref = copy.deepcopy(model)
            local_train(ref, data, LocalTraining(batch_size=b, steps=6, lr=0.2, seed=seed, dp=PerSampleDP(1.0, 1.0)))
            expected.append(dict(ref.named_parameters()))
            clients.append(BatchedClient(data, b, 6, 0.2, 1.0, 1.0, torch.Generator().manual_seed(seed)))
        got = train_clients_batched(model, clients)
        for k, ref in enumerate(expected):
            for n, p in ref.items():
                torch.testing.assert_close(got[k][n], p.detach(), rtol=1e-10, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)


def test_batched_path_rejects_models_it_cannot_run():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))  # running stats: buffers
    with pytest.raises(ValueError, match="buffers"):
        train_clients_batched(model, [])
