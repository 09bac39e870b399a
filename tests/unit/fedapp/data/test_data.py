"""Dataset loaders on the embedded digits, the real shared MNIST / a9a files, CIFAR folders written here."""

from __future__ import annotations

import numpy as np
import pytest

from fedapp.config import ConfigError
from fedapp.data.datasets import load_dataset, read_libsvm


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


def _write_cifar_batch(path, rows: int, label_key: str, classes: int, rng, bytes_keys: bool):
    """A CIFAR "python version" batch: a pickled dict, ``data`` N x 3072 uint8 (channel-major), labels a list."""
    import pickle

    data = rng.integers(0, 256, (rows, 3072), dtype=np.uint8)
    labels = rng.integers(0, classes, rows).tolist()
    entry = {"data": data, label_key: labels, "filenames": [f"{i}.png" for i in range(rows)]}
    if bytes_keys:  # as the CIFAR page's own reader sees them (pickle.load(..., encoding="bytes"))
        entry = {k.encode(): v for k, v in entry.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(entry, protocol=2))
    return data, labels


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_pickle_batches_are_read_without_torchvision(tmp_path, name):
    """torchvision's CIFAR folder layout, read directly: (N, 3, 32, 32) float32 standardized per channel with the
    dataset's mean/std, channel-major rows unflattened as (C, H, W), batches in order, int64 (fine) labels."""
    rng = np.random.default_rng(1)
    if name == "cifar10":
        folder, label_key, classes, bytes_keys = tmp_path / "cifar-10-batches-py", "labels", 10, True
        train_files, test_files, rows = [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], 3
        mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    else:
        folder, label_key, classes, bytes_keys = tmp_path / "cifar-100-python", "fine_labels", 100, False
        train_files, test_files, rows = ["train"], ["test"], 4
        mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    written = {split: [_write_cifar_batch(folder / f, rows, label_key, classes, rng, bytes_keys) for f in files]
               for split, files in (("train", train_files), ("test", test_files))}
    (folder / "readme.html").write_text("not a batch")  # other files in the folder are ignored
    train, test = load_dataset(name, str(tmp_path))
    assert train.x.shape == (rows * len(train_files), 3, 32, 32) and test.x.shape == (rows, 3, 32, 32)
    assert train.x.dtype == test.x.dtype == np.float32 and train.y.dtype == np.int64
    assert train.num_classes == test.num_classes == classes
    for part, split in ((train, "train"), (test, "test")):
        data = np.concatenate([d for d, _ in written[split]])
        assert part.y.tolist() == [y for _, labels in written[split] for y in labels]
        expected = (data.reshape(-1, 3, 32, 32) / 255.0 - np.reshape(mean, (1, 3, 1, 1))) / np.reshape(std, (1, 3, 1, 1))
        np.testing.assert_allclose(part.x, expected, rtol=0, atol=1e-5)
    # one known pixel: channel 1 (green), row 2, column 5 of the last batch's first image
    value = int(written["train"][-1][0][0, 1024 + 2 * 32 + 5])
    index = rows * (len(train_files) - 1)
    assert float(train.x[index, 1, 2, 5]) == pytest.approx((value / 255 - mean[1]) / std[1], rel=1e-5, abs=1e-6)


def test_missing_or_malformed_cifar_files_name_the_problem(tmp_path):
    import pickle

    with pytest.raises(ConfigError, match=r"'cifar10' not found .*cifar-10-batches-py/\{data_batch_1,.*test_batch\}"):
        load_dataset("cifar10", str(tmp_path))
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    (folder / "train").write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"fine_labels": [1, 2]}))
    with pytest.raises(ConfigError, match=r"'cifar100' not found .*\{train,test\}"):
        load_dataset("cifar100", str(tmp_path))
    (folder / "test").write_bytes(pickle.dumps({b"data": np.zeros((2, 1024), np.uint8), b"fine_labels": [1, 2]}))
    with pytest.raises(ValueError, match="expected N x 3072 uint8 images"):
        load_dataset("cifar100", str(tmp_path))
    (folder / "test").write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1, 2]}))
    with pytest.raises(ValueError, match="no 'data' or 'fine_labels' entry"):
        load_dataset("cifar100", str(tmp_path))


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
    from fedapp.config import resolve_config
    from fedapp.data.client_data import load_client_data

    folder = _save_images(tmp_path / "tiny", n_train=60)
    with pytest.raises(ConfigError, match="set run-config 'model'"):
        resolve_config(overrides={"dataset": f"hf:{folder}"})
    cfg = resolve_config(overrides={"dataset": f"hf:{folder}", "model": "cnn-digits", "partitioner": "pathological",
                                    "classes-per-client": 1, "local-test-fraction": 0.0})
    train, _, _ = load_client_data(cfg.data, cfg.general.seed, 0, 3)
    assert len(np.unique(train.y)) == 1 and len(train) == 20


@pytest.mark.parametrize("public", [0, 100])
def test_a_client_gathers_its_own_rows_of_a_capped_pool_and_no_others(monkeypatch, public):
    """With ``max-samples`` below the split's size a client's data is its rows of the capped pool (minus the public
    set), gathered straight from the split: the capped pool itself is never copied for it (before, every client
    load copied all ``max-samples`` rows first: 38 MB of MNIST at DP2-FedSAM's mid scale, ~18 % of its client time)."""
    from fedapp.config import resolve_config
    from fedapp.data import client_data
    from fedapp.data.datasets import ArrayDataset

    cfg = resolve_config({"dataset": "digits", "num-clients": 6, "max-samples": 1000, "public-samples": public,
                          "local-test-fraction": 0.2, "validation-fraction": 0.1})
    seed = cfg.general.seed
    pool = client_data.training_pool(cfg.data, seed)
    assert len(pool) == 1000 - public
    gathered: list[int] = []
    subset = ArrayDataset.subset

    def counting(self: ArrayDataset, idx: np.ndarray) -> ArrayDataset:
        gathered.append(len(idx))
        return subset(self, idx)

    monkeypatch.setattr(ArrayDataset, "subset", counting)
    indices = client_data.client_partition_indices(cfg.data, seed, 6)[2]
    train, val, test = client_data.load_client_data(cfg.data, seed, 2, 6)
    tr, va, te = client_data.split_client_indices(indices, cfg.data.local_test_fraction,
                                                  cfg.data.validation_fraction, seed, 2)
    assert sorted(gathered) == sorted([len(tr), len(va), len(te)])  # the client's rows only
    for got, rows in ((train, tr), (val, va), (test, te)):
        np.testing.assert_array_equal(got.x, pool.x[rows])
        np.testing.assert_array_equal(got.y, pool.y[rows])
