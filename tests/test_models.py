"""Model zoo: parameter counts from the papers, shapes, Opacus compatibility."""

from __future__ import annotations

import pytest
import torch
from opacus.validators import ModuleValidator

from fedapp.models import build_model, count_parameters

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


def test_resnet18_gn_is_torchvision_resnet18_with_the_same_state_and_outputs():
    from torch import nn

    from fedapp.tv_compat import import_torchvision

    tv = import_torchvision()
    torch.manual_seed(3)
    reference = tv.models.resnet18(num_classes=10, norm_layer=lambda c: nn.GroupNorm(min(32, c), c))
    torch.manual_seed(3)
    model = build_model("resnet18-gn", (3, 32, 32), 10)
    ref_state, state = reference.state_dict(), model.state_dict()
    assert list(state) == list(ref_state)  # checkpoints and wire order unchanged
    assert all(torch.equal(state[k], ref_state[k]) for k in state)  # same seeded initialization
    x = torch.randn(2, 3, 32, 32)
    assert torch.allclose(model(x), reference(x), atol=1e-6)


def test_the_torch_free_catalog_names_every_model_and_the_launcher_never_imports_torch():
    import subprocess
    import sys

    from fedapp.model_catalog import DEFAULT_MODEL, MODEL_NAMES
    from fedapp.models import MODELS

    assert tuple(MODELS) == MODEL_NAMES and set(DEFAULT_MODEL.values()) <= set(MODEL_NAMES)
    code = ("import sys; from fedapp.launch import PROJECT_ROOT, pyproject_run_config, resolve_config; "
            "from fedapp.faults import check_fault_config; "
            "check_fault_config(resolve_config({**pyproject_run_config(PROJECT_ROOT), 'grad-sample-mode': 'ew'})); "
            "assert 'torch' not in sys.modules, 'the launcher imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)
