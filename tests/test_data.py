"""Dataset loaders on the embedded digits and the real shared MNIST / a9a files."""

from __future__ import annotations

import numpy as np
import pytest

from fedapp.config import ConfigError
from fedapp.data import load_dataset, read_libsvm


def test_digits_embedded():
    train, test = load_dataset("digits")
    assert train.x.shape[1:] == (1, 8, 8) and len(train) + len(test) == 1797
    assert set(np.unique(test.y)) == set(range(10)) and train.x.dtype == np.float32


def test_mnist_from_shared_data(shared_data):
    train, test = load_dataset("mnist", str(shared_data))
    assert train.x.shape == (60000, 1, 28, 28) and test.x.shape == (10000, 1, 28, 28)
    assert abs(float(train.x.mean())) < 0.05 and abs(float(train.x.std()) - 1.0) < 0.05  # normalized
    assert np.bincount(train.y).tolist()[:3] == [5923, 6742, 5958]


def test_a9a_from_shared_data(shared_data):
    train, test = load_dataset("a9a", str(shared_data))
    assert train.x.shape == (32561, 123) and test.x.shape == (16281, 123)
    assert int(train.y.sum()) == 7841 and int(test.y.sum()) == 3846  # "+1" counts from SOURCES.md


def test_libsvm_reader_rejects_out_of_range_feature(tmp_path):
    f = tmp_path / "bad.svm"
    f.write_text("+1 1:1 200:1\n")
    with pytest.raises(ValueError, match="feature index 200"):
        read_libsvm(f)


def test_missing_dataset_files_give_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="a9a"):
        load_dataset("a9a", str(tmp_path))
    with pytest.raises(ConfigError, match="mnist"):
        load_dataset("mnist", str(tmp_path / "nothing-here"))
