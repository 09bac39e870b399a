"""run-config ``dataset = "module.path:loader"``: a user's own data in simulation, split by the same partitioners.
The loader's module lives outside the project; every refusal names run-config 'dataset'."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
from conftest import install_user_module

from fedapp.config import ConfigError, resolve_config
from fedapp.data.client_data import client_train_sizes, load_client_data
from fedapp.data.datasets import load_dataset

LOADERS = textwrap.dedent('''
    import numpy as np
    import torch

    def _blobs(n, seed):
        rng = np.random.default_rng(seed)
        y = rng.integers(0, 3, n)
        x = rng.normal(size=(n, 16)).astype(np.float32) + y[:, None]
        return x, y

    def arrays():
        return _blobs(300, 0), _blobs(90, 1)

    class Blobs(torch.utils.data.Dataset):
        def __init__(self, n, seed):
            self.x, self.y = _blobs(n, seed)
        def __len__(self):
            return len(self.y)
        def __getitem__(self, i):
            return torch.from_numpy(self.x[i]), int(self.y[i])

    def datasets():
        return Blobs(120, 0), Blobs(40, 1)

    def one_part():
        return _blobs(10, 0)

    def nan_inputs():
        (x, y), test = _blobs(20, 0), _blobs(10, 1)
        x[3, 2] = float("nan")
        return (x, y), test

    def fails():
        raise OSError("the records are on another disk")
''')


@pytest.fixture()
def loaders(tmp_path, monkeypatch):
    yield install_user_module(tmp_path, monkeypatch, "lab_loaders_test", LOADERS)
    sys.modules.pop("lab_loaders_test", None)


@pytest.mark.parametrize(("loader", "train_size"), [("arrays", 300), ("datasets", 120)])
def test_arrays_or_torch_datasets_become_the_pools_and_are_partitioned(loaders, loader, train_size):
    cfg = resolve_config(None, {"dataset": f"{loaders}:{loader}", "model": "mlp-digits", "partitioner": "dirichlet"})
    train, test = load_dataset(cfg.data.dataset)
    assert len(train) == train_size and train.x.shape[1:] == (16,) and train.num_classes == 3
    assert train.x.dtype == np.float32 and train.y.dtype == np.int64 and len(test) in (90, 40)
    sizes = client_train_sizes(cfg.data, cfg.general.seed, 4)
    assert len(sizes) == 4 and all(s > 0 for s in sizes)
    local_train, _, local_test = load_client_data(cfg.data, cfg.general.seed, 2, 4)
    assert len(local_train) == sizes[2] and local_train.num_classes == 3


@pytest.mark.parametrize(("loader", "match"), [
    ("one_part", "its train part is a ndarray, not \\(x, y\\) arrays"),
    ("nan_inputs", "train inputs hold NaN"),
    ("fails", "the loader raised OSError: the records are on another disk"),
])
def test_a_bad_loader_is_a_clear_error_naming_the_key(loaders, loader, match):
    with pytest.raises(ConfigError, match=f"run-config 'dataset' = .*{match}"):
        load_dataset(f"{loaders}:{loader}")


def test_the_run_config_checks_the_loader_before_the_run(loaders):
    with pytest.raises(ConfigError, match="has no default model: set run-config 'model'"):
        resolve_config(None, {"dataset": f"{loaders}:arrays"})
    with pytest.raises(ConfigError, match="run-config 'dataset' = 'no_such_loaders_mod:x': cannot import module"):
        resolve_config(None, {"dataset": "no_such_loaders_mod:x", "model": "mlp-digits"})
    with pytest.raises(ConfigError, match="has no attribute 'missing'"):
        resolve_config(None, {"dataset": f"{loaders}:missing", "model": "mlp-digits"})
