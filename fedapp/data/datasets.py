"""Datasets as in-memory arrays: digits (embedded), MNIST/FashionMNIST/CIFAR-10/CIFAR-100 (read directly from
torchvision's folder layout, without torchvision), LIBSVM a9a, Hugging Face (``hf:``).

Each loader returns ``(train, test)`` :class:`ArrayDataset` s; the test split is the
server's held-out set for centralized evaluation, the train split is partitioned among
clients (``fedapp.data.partition``). Loaded arrays are cached per process and, decoded, on disk
(:mod:`fedapp.state.cache`), memory-mapped so the processes of a run share one copy.
"""

from __future__ import annotations

import functools
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedapp.config import ConfigError
from fedapp.config.keys import is_user_dataset
from fedapp.models.catalog import A9A_FEATURES
from fedapp.state.cache import read_rows

# name -> (torchvision's class name, which names its folder layout; per-channel mean; per-channel std)
_IMAGE_SETS = {
    "mnist": ("MNIST", (0.1307,), (0.3081,)),
    "fmnist": ("FashionMNIST", (0.2860,), (0.3530,)),
    "cifar10": ("CIFAR10", (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ("CIFAR100", (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
# name -> (folder under data-dir, train batches, test batches, label key, classes): the "python version" pickles
_CIFAR = {
    "cifar10": ("cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",), "labels", 10),
    "cifar100": ("cifar-100-python", ("train",), ("test",), "fine_labels", 100),
}
_CACHE_FORMAT = 1  # bump when a decoder's output changes, so cached arrays are rebuilt


@dataclass(frozen=True)
class ArrayDataset:
    """Features ``x`` (float32, N × ...) and integer labels ``y`` (int64, N)."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"x has {len(self.x)} rows but y has {len(self.y)}")

    def __len__(self) -> int:
        return len(self.y)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def subset(self, idx: np.ndarray) -> ArrayDataset:
        """The rows ``idx``, copied (a memory-mapped pool is read without mapping it:
        :func:`fedapp.state.cache.read_rows`)."""
        return ArrayDataset(read_rows(self.x, idx), read_rows(self.y, idx), self.num_classes)


def load_digits_dataset(test_fraction: float = 0.2) -> tuple[ArrayDataset, ArrayDataset]:
    """sklearn's 8×8 digits (1,797 images, shipped with scikit-learn) with a fixed stratified holdout."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (bunch.data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    x = (x - 0.3) / 0.4  # roughly standardize
    y = bunch.target.astype(np.int64)
    idx_train, idx_test = train_test_split(np.arange(len(y)), test_size=test_fraction, stratify=y, random_state=0)
    return ArrayDataset(x[idx_train], y[idx_train], 10), ArrayDataset(x[idx_test], y[idx_test], 10)


def _read_idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST format: magic 0x0000, type code, rank, big-endian int32 dims, raw data)."""
    import gzip

    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes")
    rank = raw[3]
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">i4", count=rank, offset=4))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * rank)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} but holds {data.size} values")
    return data.reshape(dims)


def _idx_path(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _mnist_family_files(name: str, data_dir: str) -> list[Path]:
    """The four IDX files torchvision's MNIST/FashionMNIST read from ``data_dir/<Class>/raw``."""
    cls_name = _IMAGE_SETS[name][0]
    folder = Path(data_dir) / cls_name / "raw"
    stems = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    paths = [_idx_path(folder, stem) for stem in stems]
    if any(p is None for p in paths):
        raise ConfigError(
            f"dataset {name!r} not found under run-config 'data-dir' = {data_dir!r}: the files torchvision's "
            f"{cls_name} reads ({folder}/{{train,t10k}}-*-ubyte) are missing there; nothing is downloaded, "
            "put them there first")
    return [p for p in paths if p is not None]


def _normalized(name: str, images: np.ndarray) -> np.ndarray:
    """uint8 images (N, H, W) or (N, H, W, C) → float32 (N, C, H, W), standardized per channel."""
    _, mean, std = _IMAGE_SETS[name]
    x = images.astype(np.float32) / 255.0
    x = x[:, None, :, :] if x.ndim == 3 else np.transpose(x, (0, 3, 1, 2))
    m = np.asarray(mean, dtype=np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, dtype=np.float32).reshape(1, -1, 1, 1)
    return np.ascontiguousarray((x - m) / s, dtype=np.float32)


def _mnist_family_arrays(name: str, data_dir: str) -> dict[str, np.ndarray]:
    """Train and test arrays of an MNIST-format dataset, read directly (same values as torchvision's
    MNIST class yields, without importing torchvision: seconds of start-up per process)."""
    tr_x, tr_y, te_x, te_y = (_read_idx(p) for p in _mnist_family_files(name, data_dir))
    return {"train_x": _normalized(name, tr_x), "train_y": tr_y.astype(np.int64),
            "test_x": _normalized(name, te_x), "test_y": te_y.astype(np.int64), "num_classes": np.asarray([10])}


def _cifar_files(name: str, data_dir: str) -> tuple[list[Path], list[Path]]:
    """The train and test pickle batches torchvision's CIFAR10/CIFAR100 read from ``data_dir/<folder>``."""
    folder_name, train_stems, test_stems, _, _ = _CIFAR[name]
    folder = Path(data_dir) / folder_name
    train, test = [folder / s for s in train_stems], [folder / s for s in test_stems]
    if not all(p.is_file() for p in train + test):
        raise ConfigError(
            f"dataset {name!r} not found under run-config 'data-dir' = {data_dir!r}: the files torchvision's "
            f"{_IMAGE_SETS[name][0]} reads ({folder}/{{{','.join(train_stems + test_stems)}}}) are missing there; "
            "nothing is downloaded, put them there first")
    return train, test


def _read_cifar_batches(paths: list[Path], label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 32, 32, 3) uint8 and labels (N,) int64 of CIFAR "python version" batches, as torchvision's CIFAR
    classes hold them: each batch a pickled dict whose ``data`` is N × 3072 uint8, channel-major (1024 red, 1024
    green, 1024 blue values, each row-major), and ``label_key`` a list of N ints. The original (Python 2) files
    are read as torchvision does (``encoding="latin1"``: str keys); bytes keys (``b"data"``) are accepted too."""
    images, labels = [], []
    for path in paths:
        with open(path, "rb") as fh:
            raw = pickle.load(fh, encoding="latin1")  # the dataset's own format; data-dir is trusted, as by torchvision
        entry = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in dict(raw).items()}
        if "data" not in entry or label_key not in entry:
            raise ValueError(f"{path} is not a CIFAR batch: it has no 'data' or {label_key!r} entry")
        data, y = np.asarray(entry["data"]), np.asarray(entry[label_key], dtype=np.int64)
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(y) != len(data):
            raise ValueError(f"{path}: expected N x 3072 uint8 images and N labels, got {data.dtype} "
                             f"{data.shape} and {len(y)} labels")
        images.append(data)
        labels.append(y)
    return np.concatenate(images).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), np.concatenate(labels)


def _cifar_arrays(name: str, data_dir: str) -> dict[str, np.ndarray]:
    """Train and test arrays of CIFAR-10/100, read directly: the values torchvision's CIFAR classes yield (CIFAR-100:
    the fine labels), normalized by :func:`_normalized` like every image set, without importing torchvision."""
    _, _, _, label_key, classes = _CIFAR[name]
    out: dict[str, np.ndarray] = {"num_classes": np.asarray([classes])}
    for split, paths in zip(("train", "test"), _cifar_files(name, data_dir), strict=True):
        images, labels = _read_cifar_batches(paths, label_key)
        out[f"{split}_x"], out[f"{split}_y"] = _normalized(name, images), labels
    return out


def _source_files(name: str, data_dir: str) -> list[Path]:
    """The files a dataset is decoded from (their sizes and mtimes key the array cache)."""
    if name in ("mnist", "fmnist"):
        return _mnist_family_files(name, data_dir)
    if name in _CIFAR:
        train, test = _cifar_files(name, data_dir)
        return train + test
    return list(_a9a_paths(data_dir))


def _decoded(name: str, data_dir: str, build) -> tuple[ArrayDataset, ArrayDataset]:
    """``build()``'s arrays through the shared cache (:mod:`fedapp.state.cache`) when the sources can be fingerprinted."""
    from fedapp.state.cache import cached_arrays, fingerprint, library_versions

    files = _source_files(name, data_dir)
    key = fingerprint(files, _CACHE_FORMAT, library_versions("numpy", "scikit-learn"))
    arrays = cached_arrays(f"{name}-{key}", build) if files else build()
    k = int(arrays["num_classes"][0])
    return (ArrayDataset(arrays["train_x"], arrays["train_y"], k), ArrayDataset(arrays["test_x"], arrays["test_y"], k))


def read_libsvm(path: str | os.PathLike, num_features: int = A9A_FEATURES) -> ArrayDataset:
    """Read a LIBSVM file (``label idx:val ...``, 1-based indices) into dense arrays; labels ±1 → {0, 1}."""
    rows: list[np.ndarray] = []
    labels: list[int] = []
    with open(path, encoding="ascii") as fh:
        for line_no, line in enumerate(fh, 1):
            parts = line.split()
            if not parts:
                continue
            row = np.zeros(num_features, dtype=np.float32)
            for token in parts[1:]:
                idx_s, _, val_s = token.partition(":")
                idx = int(idx_s)
                if not 1 <= idx <= num_features:
                    raise ValueError(f"{path}:{line_no}: feature index {idx} outside 1..{num_features}")
                row[idx - 1] = float(val_s)
            rows.append(row)
            labels.append(1 if float(parts[0]) > 0 else 0)
    return ArrayDataset(np.stack(rows), np.asarray(labels, dtype=np.int64), 2)


def _a9a_paths(data_dir: str) -> tuple[Path, Path]:
    for base in (Path(data_dir) / "a9a", Path(data_dir)):
        if (base / "a9a").is_file() and (base / "a9a.t").is_file():
            return base / "a9a", base / "a9a.t"
    raise ConfigError(f"dataset 'a9a' needs files a9a and a9a.t under data-dir {data_dir!r} (or its a9a/ folder)")


def _a9a_arrays(data_dir: str) -> dict[str, np.ndarray]:
    train_path, test_path = _a9a_paths(data_dir)
    train, test = read_libsvm(train_path), read_libsvm(test_path)
    return {"train_x": train.x, "train_y": train.y, "test_x": test.x, "test_y": test.y, "num_classes": np.asarray([2])}


@functools.lru_cache(maxsize=4)
def load_dataset(name: str, data_dir: str = "") -> tuple[ArrayDataset, ArrayDataset]:
    """Load ``(train, test)`` for dataset ``name`` (memoized, so shared by every caller in the process: its
    arrays are read-only — callers take copies — which also lets a memory-mapped pool drop its pages,
    :func:`fedapp.state.cache.release_mapped_pages`)."""
    pair = _load_dataset(name, data_dir)
    for part in pair:
        part.x.flags.writeable = False
        part.y.flags.writeable = False
    return pair


def _load_dataset(name: str, data_dir: str) -> tuple[ArrayDataset, ArrayDataset]:
    if name == "digits":
        return load_digits_dataset()
    if name in _IMAGE_SETS:
        if not data_dir:
            raise ConfigError(f"dataset {name!r} needs run-config 'data-dir'")
        if name in ("mnist", "fmnist"):
            return _decoded(name, data_dir, lambda: _mnist_family_arrays(name, data_dir))
        return _decoded(name, data_dir, lambda: _cifar_arrays(name, data_dir))
    if name == "a9a":
        return _decoded(name, data_dir, lambda: _a9a_arrays(data_dir))
    if is_user_dataset(name):  # a user's loader (fedapp.data.user_data)
        from fedapp.data.user_data import load_user_arrays

        tx, ty, vx, vy, classes = load_user_arrays(name)
        return ArrayDataset(tx, ty, classes), ArrayDataset(vx, vy, classes)
    if name.startswith("hf:"):  # a Hugging Face dataset (fedapp.data.hf_data documents the syntax)
        from fedapp.data.hf_data import load_hf

        train, test = load_hf(name, data_dir)
        return ArrayDataset(*train), ArrayDataset(*test)
    raise ConfigError(f"unknown dataset {name!r}; valid: digits, mnist, fmnist, cifar10, cifar100, a9a, hf:<name>, "
                      "module.path:loader")
