"""Model zoo: parameter counts from the papers, shapes, Opacus compatibility."""

from __future__ import annotations

import math

import pytest
import torch
from opacus.validators import ModuleValidator

from fedapp.models.zoo import build_model, count_parameters

CASES = [
    ("cnn-mnist", (1, 28, 28), 10, 28_938),  # Robust-HDP Table 5
    ("cnn-fmnist", (1, 28, 28), 10, 1_663_370),  # Fed-SMP Sec. 6.1, "about 1.6 million"
    ("cnn-cifar", (3, 32, 32), 10, 667_402),  # DP2-FedSAM Sec. 5.1
    ("mlp-sigmoid", (1, 28, 28), 10, 784 * 64 + 64 + 64 * 10 + 10),  # SoteriaFL 784-64-10
    ("resnet18-gn", (3, 32, 32), 10, 11_181_642),  # Robust-HDP Table 6 / DP2-FedSAM
    ("logreg", (123,), 2, 124),  # a9a
    ("cnn-digits", (1, 8, 8), 10, 6_058),
    ("mlp-digits", (1, 8, 8), 10, 64 * 32 + 32 + 32 * 10 + 10),
]


@pytest.mark.parametrize("name,shape,classes,expected", CASES)
def test_parameter_count_shape_and_opacus(name, shape, classes, expected):
    model = build_model(name, shape, classes)
    assert count_parameters(model) == expected
    out = model(torch.zeros(3, *shape))
    assert out.shape == (3, classes)
    assert ModuleValidator.validate(model, strict=False) == []


def test_nonconvex_regularizer_matches_formula():
    model = build_model("logreg", (5,), 2, nonconvex_lambda=0.2)
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.isclose(model.regularization(), 0.2 * torch.sum(w**2 / (1 + w**2)))


def test_unknown_model_and_wrong_input_rank():
    with pytest.raises(ValueError, match="unknown model"):
        build_model("nope", (1, 8, 8), 10)
    with pytest.raises(ValueError, match="image inputs"):
        build_model("cnn-mnist", (784,), 10)


@pytest.mark.parametrize("name,shape,classes,expected", CASES)
def test_no_inplace_ops_under_opacus_hooks(name, shape, classes, expected):
    """Opacus' backward hooks forbid in-place ops on module outputs (torchvision's ReLU(inplace=True), ``+=``)."""
    model = build_model(name, shape, classes)
    assert [n for n, m in model.named_modules() if getattr(m, "inplace", False)] == []


def _resnet18_gn_state_shapes(in_channels: int = 3, num_classes: int = 10) -> dict[str, tuple[int, ...]]:
    """torchvision's ``resnet18`` ``state_dict`` (keys in order, shapes) with GroupNorm for BatchNorm — no running
    statistics — written out from the architecture: stem conv 7x7/2 + norm, layer1..4 of two BasicBlocks with
    64/128/256/512 channels (block 0 of layers 2-4: stride 2 and a conv1x1 + norm ``downsample``), fc."""
    shapes: dict[str, tuple[int, ...]] = {"conv1.weight": (64, in_channels, 7, 7), "bn1.weight": (64,), "bn1.bias": (64,)}
    previous = 64
    for layer, channels in enumerate((64, 128, 256, 512), start=1):
        for block in (0, 1):
            p, cin = f"layer{layer}.{block}.", previous if block == 0 else channels
            shapes |= {p + "conv1.weight": (channels, cin, 3, 3), p + "bn1.weight": (channels,),
                       p + "bn1.bias": (channels,), p + "conv2.weight": (channels, channels, 3, 3),
                       p + "bn2.weight": (channels,), p + "bn2.bias": (channels,)}
            if block == 0 and cin != channels:
                shapes |= {p + "downsample.0.weight": (channels, cin, 1, 1), p + "downsample.1.weight": (channels,),
                           p + "downsample.1.bias": (channels,)}
        previous = channels
    return shapes | {"fc.weight": (num_classes, 512), "fc.bias": (num_classes,)}


def test_resnet18_gn_is_torchvision_resnet18_with_groupnorm():
    """Built without torchvision: torchvision's state_dict keys and shapes (checkpoints and wire order), its
    initialization, GroupNorm(min(32, c), c) everywhere, no in-place op, outputs (N, classes)."""
    from torch import nn

    torch.manual_seed(3)
    model = build_model("resnet18-gn", (3, 32, 32), 10)
    expected = _resnet18_gn_state_shapes()
    state = model.state_dict()
    assert [(k, tuple(v.shape)) for k, v in state.items()] == list(expected.items())
    assert count_parameters(model) == sum(math.prod(s) for s in expected.values()) == 11_181_642
    assert [(k, tuple(v.shape)) for k, v in build_model("resnet18-gn", (1, 28, 28), 100).state_dict().items()] \
        == list(_resnet18_gn_state_shapes(1, 100).items())
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert len(norms) == 20 and all(m.num_groups == min(32, m.num_channels) for m in norms)
    assert not [m for m in model.modules() if "BatchNorm" in type(m).__name__]
    assert [n for n, m in model.named_modules() if getattr(m, "inplace", False)] == []
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) and not bool(m.bias.any()) for m in norms)
    conv = model.layer4[1].conv2.weight.detach()  # kaiming_normal_(fan_out, relu): std sqrt(2 / (512 * 3 * 3))
    assert abs(float(conv.mean())) < 1e-3 and float(conv.std()) == pytest.approx(math.sqrt(2 / (512 * 9)), rel=0.02)
    bound = 1 / math.sqrt(512)  # PyTorch's default Linear init, untouched as in torchvision
    fc = model.fc.weight.detach(), model.fc.bias.detach()
    assert all(float(p.abs().max()) <= bound for p in fc)
    torch.manual_seed(3)
    again = build_model("resnet18-gn", (3, 32, 32), 10)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in state.items())  # seeded by the caller
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


def test_the_models_and_datasets_never_import_torchvision():
    """No module of the project needs torchvision (it is not a dependency): importing the data and model code and
    building every model of the zoo, in a fresh process where ``import torchvision`` would fail."""
    import subprocess
    import sys

    cases = [(name, shape, classes) for name, shape, classes, _ in CASES]
    code = ("import sys; sys.modules['torchvision'] = None  # any import of it now raises ImportError\n"
            "import fedapp.data.datasets, fedapp.models.zoo, fedapp.apps.client_app, fedapp.apps.server_app\n"
            f"for name, shape, classes in {cases!r}:\n"
            "    fedapp.models.zoo.build_model(name, shape, classes)\n"
            "assert sys.modules['torchvision'] is None and not [m for m in sys.modules if m.startswith('torchvision.')]\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_torch_free_catalog_names_every_model_and_the_launcher_never_imports_torch():
    import subprocess
    import sys

    from fedapp.models.catalog import DEFAULT_MODEL, MODEL_NAMES
    from fedapp.models.zoo import MODELS

    assert tuple(MODELS) == MODEL_NAMES and set(DEFAULT_MODEL.values()) <= set(MODEL_NAMES)
    code = ("import sys; from fedapp.run.launch import PROJECT_ROOT, pyproject_run_config, resolve_config; "
            "from fedapp.config import check_fault_config; "
            "check_fault_config(resolve_config({**pyproject_run_config(PROJECT_ROOT), 'grad-sample-mode': 'ew'}).deployment); "
            "assert 'torch' not in sys.modules, 'the launcher imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)
