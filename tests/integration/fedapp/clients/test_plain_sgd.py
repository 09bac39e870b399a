"""fedapp.clients.training.PlainSGD steps exactly as torch.optim.SGD does (alone and wrapped by Opacus), and local
training no longer imports torch._dynamo (what constructing a torch optimizer costs every Ray actor)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fedapp.clients.training import PlainSGD
from fedapp.models.zoo import MnistCNN


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_plain_sgd_matches_torch_sgd_bit_for_bit(momentum: float, set_to_none: bool) -> None:
    torch.manual_seed(0)
    a = MnistCNN()
    b = MnistCNN()
    b.load_state_dict(a.state_dict())
    start = {k: v.clone() for k, v in a.state_dict().items()}
    opt_a = torch.optim.SGD(a.parameters(), lr=0.05, momentum=momentum)
    opt_b = PlainSGD(list(b.parameters()), lr=0.05, momentum=momentum)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(5):
        x = torch.randn(16, 1, 28, 28, generator=torch.Generator().manual_seed(step))
        y = torch.arange(16) % 10
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad(set_to_none=set_to_none)
            loss_fn(model(x), y).backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert any(not torch.equal(pa, start[name]) for (name, pa) in a.named_parameters())  # it did train


@pytest.mark.parametrize("dp", ["None", "PerSampleDP(noise_multiplier=1.0, clip=1.0, grad_sample_mode='hooks')"],
                         ids=["client-level", "dpsgd-hooks"])
def test_local_training_does_not_import_torch_dynamo(dp: str) -> None:
    code = ("import sys, json, numpy as np\n"
            "from fedapp.data.datasets import ArrayDataset\n"
            "from fedapp.models.zoo import MnistCNN\n"
            "from fedapp.clients.training import LocalTraining, PerSampleDP, local_train\n"
            "d = ArrayDataset(np.random.rand(64, 1, 28, 28).astype('float32'), np.arange(64) % 10, 10)\n"
            f"local_train(MnistCNN(), d, LocalTraining(batch_size=16, steps=4, lr=0.1, momentum=0.9, dp={dp}))\n"
            "print(json.dumps('torch._dynamo' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=180)
    assert json.loads(out.stdout.strip().splitlines()[-1]) is False


@pytest.mark.parametrize("mode", ["hooks", "ew", "functorch"])
@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_dpsgd_through_plain_sgd_matches_opacus_wrapping_torch_sgd(monkeypatch, mode: str, momentum: float) -> None:
    """Opacus' DPOptimizer wrapping PlainSGD takes the same steps, bit for bit, as wrapping torch.optim.SGD
    (same Poisson batches, clipping and noise: the seeds are the same)."""
    import numpy as np

    import fedapp.clients.training as training
    from fedapp.clients.training import LocalTraining, PerSampleDP, local_train
    from fedapp.data.datasets import ArrayDataset

    rng = np.random.default_rng(0)
    data = ArrayDataset(rng.normal(size=(48, 1, 28, 28)).astype("float32"), np.arange(48) % 10, 10)
    spec = LocalTraining(batch_size=8, steps=12, lr=0.1, momentum=momentum, seed=3,
                         dp=PerSampleDP(noise_multiplier=1.0, clip=0.5, grad_sample_mode=mode))
    torch.manual_seed(0)
    start = MnistCNN().state_dict()

    def trained() -> dict[str, torch.Tensor]:
        model = MnistCNN()
        model.load_state_dict(start)
        result = local_train(model, data, spec)
        assert result.steps == 12
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    ours = trained()
    monkeypatch.setattr(training, "PlainSGD", lambda params, lr, momentum: torch.optim.SGD(params, lr=lr,
                                                                                            momentum=momentum))
    reference = trained()
    for name, p in ours.items():
        assert torch.equal(p, reference[name])
    assert any(not torch.equal(p, start[name]) for name, p in ours.items())  # it did train
