"""run-config ``model = "module.path:factory"``: a user's own PyTorch model, checked before the run.

The user's module lives outside the project (a temporary folder on ``sys.path``, as an app folder or an installed
package would be), and every refusal names run-config 'model' (or 'dp2-head')."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
from conftest import install_user_module

from fedapp.config import ConfigError, resolve_config
from fedapp.data.datasets import load_dataset
from fedapp.models.catalog import INPUT_SHAPES, NUM_CLASSES
from fedapp.models.zoo import build_model

USER_MODULE = textwrap.dedent('''
    import math
    from torch import nn

    class TinyNet(nn.Module):
        def __init__(self, features, classes):
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(features, 24), nn.Tanh())
            self.out = nn.Linear(24, classes)

        def forward(self, x):
            return self.out(self.body(x))

    def make(input_shape, num_classes):
        return TinyNet(math.prod(input_shape), num_classes)

    def with_batchnorm(input_shape, num_classes):
        return nn.Sequential(nn.Conv2d(input_shape[0], 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(),
                             nn.Linear(4 * input_shape[1] * input_shape[2], num_classes))

    def wrong_output(input_shape, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes + 1))

    def not_a_module(input_shape, num_classes):
        return "a string"

    NOT_CALLABLE = 3
''')


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    yield install_user_module(tmp_path, monkeypatch, "usernet_test_mod", USER_MODULE)
    sys.modules.pop("usernet_test_mod", None)


def test_a_users_factory_builds_the_model_for_the_datasets_shapes(user_module):
    cfg = resolve_config(None, {"strategy": "robust-hdp", "model": f"{user_module}:make"})
    assert cfg.model_spec.name == f"{user_module}:make"
    model = build_model(cfg.model_spec.name, INPUT_SHAPES["digits"], 10)
    assert type(model).__name__ == "TinyNet" and sum(p.numel() for p in model.parameters()) == 64 * 24 + 24 + 250


@pytest.mark.parametrize(("factory", "strategy", "match"), [
    ("nowhere_module_xyz:make", "robust-hdp", "cannot import module 'nowhere_module_xyz'"),
    ("{m}:missing", "robust-hdp", "has no attribute 'missing'"),
    ("{m}:NOT_CALLABLE", "robust-hdp", "is not callable"),
    ("{m}:not_a_module", "robust-hdp", "returned a str, not an nn.Module"),
    ("{m}:wrong_output", "robust-hdp", r"gives output \(2, 11\), expected \(2, 10\)"),
    ("{m}:with_batchnorm", "dpsgd-fedavg", "BatchNorm2d -> GroupNorm"),
])
def test_what_cannot_run_is_refused_before_the_run_naming_the_key(user_module, factory, strategy, match):
    with pytest.raises(ConfigError, match=f"run-config 'model' = .*{match}"):
        resolve_config(None, {"strategy": strategy, "model": factory.format(m=user_module)})


def test_batchnorm_is_accepted_where_no_per_sample_gradient_is_taken(user_module):
    resolve_config(None, {"strategy": "dp-fedavg", "model": f"{user_module}:with_batchnorm"})  # client-level DP


def test_the_dp2_fedsam_head_must_name_the_users_modules(user_module):
    model = f"{user_module}:make"
    resolve_config(None, {"strategy": "dp2-fedsam", "model": model})  # auto: the last nn.Linear, here `out`
    resolve_config(None, {"strategy": "dp2-fedsam", "model": model, "dp2-head": "out"})
    with pytest.raises(ConfigError, match="'dp2-head' = 'fc'.*matches no parameter"):
        resolve_config(None, {"strategy": "dp2-fedsam", "model": model, "dp2-head": "fc"})


def test_the_class_counts_match_the_loaders():
    train, _ = load_dataset("digits")
    assert NUM_CLASSES["digits"] == train.num_classes == int(np.max(train.y)) + 1


def test_auto_keeps_the_modes_that_run_on_a_users_model(monkeypatch):
    import torch

    from fedapp.clients import grad_sample_mode as gsm

    def timed(new_model, shape, classes, batch, device, modes):
        if "ew" in modes:
            raise RuntimeError("this layer has no ew grad sampler")
        return {m: {"hooks": 2.0, "functorch": 1.0}[m] for m in modes}

    monkeypatch.setattr(gsm, "time_modes", timed)
    args = (lambda: None, (1, 8, 8), 10, 16, torch.device("cpu"))
    assert gsm.time_modes_that_run(*args, ("hooks", "ew", "functorch")) == {"hooks": 2.0, "functorch": 1.0}
    assert gsm.time_modes_that_run(*args, ("ew",)) == {"hooks": float("inf")}  # nothing runs: hooks, to fail loudly
