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


def _save_images(path, n_train=40, n_test=10, channels=None):
    """A small image DatasetDict with a non-default label column, saved with save_to_disk."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image
    from PIL import Image as PILImage

    rng = np.random.default_rng(0)
    shape = (6, 6) if channels is None else (6, 6, channels)

    def split(n):
        imgs = [PILImage.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)) for _ in range(n)]
        labels = (np.arange(n) % 3).tolist()
        return Dataset.from_dict({"img": imgs, "fine": labels},
                                 features=Features({"img": Image(), "fine": ClassLabel(names=["a", "b", "c"])}))

    DatasetDict(train=split(n_train), test=split(n_test)).save_to_disk(str(path))
    return path


def test_hf_dataset_from_a_save_to_disk_folder(tmp_path):
    folder = _save_images(tmp_path / "tiny")
    train, test = load_dataset(f"hf:{folder}")  # label: the only ClassLabel column; features: 'img'
    assert train.x.shape == (40, 1, 6, 6) and test.x.shape == (10, 1, 6, 6) and train.x.dtype == np.float32
    assert train.num_classes == 3 and train.y.tolist()[:4] == [0, 1, 2, 0] and train.y.dtype == np.int64
    assert abs(float(train.x.mean())) < 1e-4 and abs(float(train.x.std()) - 1.0) < 1e-3  # standardized by train
    relative, _ = load_dataset("hf:tiny?label=fine&features=img&test=test", str(tmp_path))  # relative to data-dir
    assert np.array_equal(relative.x, train.x) and np.array_equal(relative.y, train.y)


def test_hf_rgb_images_are_channels_first(tmp_path):
    train, _ = load_dataset(f"hf:{_save_images(tmp_path / 'rgb', channels=3)}")
    assert train.x.shape == (40, 3, 6, 6)


def test_hf_tabular_dataset_without_test_split_holds_out_a_fifth(tmp_path):
    from datasets import Dataset

    rng = np.random.default_rng(1)
    Dataset.from_dict({"a": rng.normal(size=50), "b": rng.normal(size=50), "label": np.arange(50) % 2}
                      ).save_to_disk(str(tmp_path / "tab"))
    train, test = load_dataset(f"hf:{tmp_path / 'tab'}")
    assert train.x.shape == (40, 2) and test.x.shape == (10, 2) and train.num_classes == 2
    assert np.bincount(test.y).tolist() == [5, 5]  # stratified


def test_hf_bad_specs_name_the_problem(tmp_path):
    folder = _save_images(tmp_path / "tiny")
    with pytest.raises(ConfigError, match="unknown option"):
        load_dataset(f"hf:{folder}?colour=red")
    with pytest.raises(ConfigError, match="no split 'validation'"):
        load_dataset(f"hf:{folder}?test=validation")
    with pytest.raises(ConfigError, match="no column 'target'"):
        load_dataset(f"hf:{folder}?label=target")
    with pytest.raises(ConfigError, match="could not be loaded"):
        load_dataset(f"hf:{tmp_path / 'empty'}", str(tmp_path))  # neither a folder here nor on the Hub offline


def test_hf_dataset_in_the_run_config_partitions_like_any_other(tmp_path):
    from fedapp.client_data import load_client_data
    from fedapp.config import resolve_config

    folder = _save_images(tmp_path / "tiny", n_train=60)
    with pytest.raises(ConfigError, match="set run-config 'model'"):
        resolve_config(overrides={"dataset": f"hf:{folder}"})
    cfg = resolve_config(overrides={"dataset": f"hf:{folder}", "model": "cnn-digits", "partitioner": "pathological",
                                    "classes-per-client": 1, "local-test-fraction": 0.0})
    train, _, _ = load_client_data(cfg, 0, 3)
    assert len(np.unique(train.y)) == 1 and len(train) == 20
