"""DP-SGD's Poisson batches drawn where the data lives (``fedapp.clients.training._poisson_batches``).

The privacy analysis composes the Poisson-subsampled Gaussian mechanism with rate q = 1/⌈N/b⌉ (Opacus'
``DPDataLoader``). The batches are drawn on the data's device instead of by that loader; on the CPU they must
be the loader's own, draw for draw (so the noise that follows them is too), and on any device they must have
its law: every record in every step independently with probability q.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from opacus import PrivacyEngine
from opacus.data_loader import DPDataLoader
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedapp.clients.training import LocalTraining, PerSampleDP, _poisson_batches, get_weights, local_train
from fedapp.data.datasets import ArrayDataset
from fedapp.models.zoo import build_model


def _arrays(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return (torch.from_numpy(rng.standard_normal((n, 1, 8, 8)).astype(np.float32)),
            torch.from_numpy(rng.integers(0, 10, n).astype(np.int64)))


def test_cpu_batches_are_opacus_loader_batches_draw_for_draw():
    """Same records, same order, same empty batches, and the generator left where the loader leaves it
    (a normal draw after every batch stands for the optimizer's noise)."""
    x, y = _arrays(6)  # b = 1: q = 1/6, a third of the batches are empty
    loader = DPDataLoader.from_data_loader(DataLoader(TensorDataset(x, y), batch_size=1))
    epochs, per_epoch = 5, len(loader)
    torch.manual_seed(3)
    expected = []
    for _ in range(epochs):
        for xb, yb in loader:
            expected.append((xb.clone(), yb.clone(), torch.randn(2)))
    torch.manual_seed(3)
    got = [(xb, yb, torch.randn(2)) for xb, yb in _poisson_batches(x, y, 1.0 / per_epoch, per_epoch, epochs)]
    assert len(got) == len(expected) == 30
    assert any(len(e[1]) == 0 for e in expected) and any(len(e[1]) > 1 for e in expected)
    for (gx, gy, gn), (ex, ey, en) in zip(got, expected):
        assert gx.shape == ex.shape and gy.dtype == ey.dtype
        assert torch.equal(gx, ex) and torch.equal(gy, ey) and torch.equal(gn, en)


def _through_opacus_loader(model: nn.Module, data: ArrayDataset, spec: LocalTraining) -> list[np.ndarray]:
    """DP-SGD iterating Opacus' own Poisson loader: make_private's loader, SGD, hooks."""
    assert spec.dp is not None
    loader = DataLoader(TensorDataset(torch.from_numpy(data.x), torch.from_numpy(data.y)), batch_size=spec.batch_size)
    torch.manual_seed(spec.seed)
    module, optimizer, dp_loader = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=spec.lr), data_loader=loader,
        noise_multiplier=spec.dp.noise_multiplier, max_grad_norm=spec.dp.clip, poisson_sampling=True,
        grad_sample_mode="hooks")
    for _ in range(-(-spec.steps // len(dp_loader))):
        for xb, yb in dp_loader:
            optimizer.zero_grad()
            nn.CrossEntropyLoss()(module(xb), yb).backward()
            optimizer.step()
    return get_weights(module._module)


def test_local_dpsgd_on_cpu_equals_training_through_opacus_loader():
    x, y = _arrays(40, seed=1)
    data = ArrayDataset(x.numpy(), y.numpy(), 10)
    spec = LocalTraining(batch_size=8, steps=10, lr=0.1, seed=7, dp=PerSampleDP(0.8, 1.0, "hooks"))  # 2 epochs
    model = build_model("cnn-digits", (1, 8, 8), 10)
    expected = _through_opacus_loader(copy.deepcopy(model), data, spec)
    result = local_train(model, data, spec, torch.device("cpu"))
    assert result.steps == 10 and result.extra["sample_rate"] == 0.2
    got = get_weights(model)
    assert any(not np.array_equal(a, b) for a, b in zip(got, get_weights(build_model("cnn-digits", (1, 8, 8), 10))))
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


def test_batches_have_the_poisson_law_on_the_test_device(device: torch.device):
    """Each record joins each step with probability q, independently of the step: inclusion frequency per record
    and batch-size mean and variance within 5 standard errors over 4,000 seeded steps."""
    n, per_epoch, epochs = 200, 10, 400
    q, steps = 1.0 / per_epoch, per_epoch * epochs
    x = torch.arange(n, dtype=torch.float32, device=device).reshape(n, 1)
    y = torch.zeros(n, dtype=torch.int64, device=device)
    torch.manual_seed(11)
    counts, sizes = torch.zeros(n, device=device), []
    for xb, yb in _poisson_batches(x, y, q, per_epoch, epochs):
        assert xb.device.type == device.type and len(xb) == len(yb)
        rows = xb.reshape(-1).long()
        assert len(torch.unique(rows)) == len(rows)  # without replacement within a step
        counts[rows] += 1
        sizes.append(len(rows))
    freq = counts.cpu().numpy() / steps
    assert np.abs(freq - q).max() < 5 * np.sqrt(q * (1 - q) / steps)
    s = np.array(sizes, dtype=float)
    assert abs(s.mean() - n * q) < 5 * np.sqrt(n * q * (1 - q) / steps)
    assert abs(s.var() / (n * q * (1 - q)) - 1) < 5 * np.sqrt(2 / steps)


def test_an_epoch_is_ceil_n_over_b_steps_at_q_one_over_that_where_opacus_loader_has_one_batch_less():
    """⌈N/b⌉ = 93: Opacus' ``DPDataLoader`` has int(1/(1/93)) = 92 batches, and ``make_private`` reports q = 1/92
    for a loader that samples at 1/93; the client's accountant composes 93 steps at 1/93 a local epoch (and
    a client whose training ran another q or step count fails the round)."""
    assert int(1 / (1 / 93)) == 92
    x, y = _arrays(93, seed=2)
    result = local_train(build_model("cnn-digits", (1, 8, 8), 10), ArrayDataset(x.numpy(), y.numpy(), 10),
                         LocalTraining(batch_size=1, steps=93, lr=0.1, seed=1, dp=PerSampleDP(1.0, 1.0, "hooks")),
                         torch.device("cpu"))
    assert result.steps == 93 and result.extra["sample_rate"] == 1 / 93


def test_the_non_private_loops_batches_are_each_epochs_permutation_in_slices():
    """``_shuffled_batches`` (one gather per epoch, contiguous slices) yields, batch for batch, the rows of a seeded
    per-epoch permutation taken b at a time: the batches the loop had when it gathered each batch's rows itself,
    a short last batch and a partial last epoch included."""
    from fedapp.clients.training import _shuffled_batches

    x, y = _arrays(50)
    got = list(_shuffled_batches(x, y, batch_size=16, steps=9, seed=5))
    rng = np.random.default_rng(5)
    expected, order, pos = [], np.empty(0, dtype=np.int64), 0
    for _ in range(9):
        if pos >= len(order):
            order, pos = rng.permutation(50), 0
        rows = torch.from_numpy(order[pos:pos + 16])
        expected.append((x[rows], y[rows]))
        pos += 16
    assert [len(b[1]) for b in got] == [16, 16, 16, 2, 16, 16, 16, 2, 16]
    for (xb, yb), (xe, ye) in zip(got, expected, strict=True):
        assert xb.is_contiguous() and torch.equal(xb, xe) and torch.equal(yb, ye)


def test_two_clients_training_at_once_on_threads_draw_what_each_draws_alone():
    """ClientApps on threads of one process (fedapp.compat.thread_backend) train at the same time: each client's
    batches and noise come from its own seeded stream, not from the process's default generator, which the other
    client would draw from and reseed. Each result equals the one the client gets training alone."""
    import sys
    import threading

    x, y = _arrays(64, seed=4)
    data = ArrayDataset(x.numpy(), y.numpy(), 10)
    specs = {seed: LocalTraining(batch_size=8, steps=40, lr=0.1, seed=seed, dp=PerSampleDP(1.0, 1.0, mode))
             for seed, mode in ((21, "hooks"), (22, "bk"))}
    start = build_model("cnn-digits", (1, 8, 8), 10)
    alone = {}
    for seed, spec in specs.items():
        model = copy.deepcopy(start)
        local_train(model, data, spec, torch.device("cpu"))
        alone[seed] = get_weights(model)
    together: dict[int, list[np.ndarray]] = {}
    barrier = threading.Barrier(len(specs))

    def train(seed: int) -> None:
        model = copy.deepcopy(start)
        barrier.wait()
        local_train(model, data, specs[seed], torch.device("cpu"))
        together[seed] = get_weights(model)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the two loops interleave step by step
    try:
        threads = [threading.Thread(target=train, args=(seed,)) for seed in specs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    for seed in specs:
        for a, b in zip(together[seed], alone[seed]):
            np.testing.assert_array_equal(a, b)


def test_a_client_seeds_the_default_generator_only_between_other_clients_seeded_builds():
    """A client about to run DP-SGD seeds the process's default generator; a model being built from its seed on
    another thread (fedapp.clients.common.model_for_shape) holds that generator meanwhile and must not see the seed
    change under it. The training waits for the build's lock."""
    import threading

    from fedapp.clients.training import DEFAULT_GENERATOR

    x, y = _arrays(32, seed=5)
    data = ArrayDataset(x.numpy(), y.numpy(), 10)
    spec = LocalTraining(batch_size=8, steps=4, lr=0.1, seed=99, dp=PerSampleDP(1.0, 1.0, "hooks"))
    model = build_model("cnn-digits", (1, 8, 8), 10)
    torch.manual_seed(7)
    expected = torch.rand(3)
    with DEFAULT_GENERATOR:  # as a seeded build on another thread holds it
        torch.manual_seed(7)
        trainer = threading.Thread(target=local_train, args=(model, data, spec, torch.device("cpu")))
        trainer.start()
        trainer.join(timeout=3.0)  # long enough for the whole training, had it not waited
        drawn = torch.rand(3)
        assert trainer.is_alive()
    trainer.join(timeout=60)
    assert not trainer.is_alive()
    torch.testing.assert_close(drawn, expected, rtol=0, atol=0)
