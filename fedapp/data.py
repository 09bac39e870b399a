"""Datasets as in-memory arrays: digits (embedded), torchvision image sets, LIBSVM a9a, Hugging Face (``hf:``).

Each loader returns ``(train, test)`` :class:`ArrayDataset` s; the test split is the
server's held-out set for centralized evaluation, the train split is partitioned among
clients (``fedapp.partition``). Loaded arrays are cached per process.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedapp.config import ConfigError

# name -> (torchvision class, channels, mean, std)
_TORCHVISION = {
    "mnist": ("MNIST", (0.1307,), (0.3081,)),
    "fmnist": ("FashionMNIST", (0.2860,), (0.3530,)),
    "cifar10": ("CIFAR10", (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ("CIFAR100", (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
A9A_FEATURES = 123


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
        return ArrayDataset(self.x[idx], self.y[idx], self.num_classes)


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


def _torchvision_arrays(name: str, data_dir: str, train: bool) -> ArrayDataset:
    from fedapp.tv_compat import import_torchvision

    tv = import_torchvision()
    cls_name, mean, std = _TORCHVISION[name]
    cls = getattr(tv.datasets, cls_name)
    try:
        ds = cls(data_dir, train=train, download=False)  # never downloads: runs are offline and reproducible
    except RuntimeError:
        raise ConfigError(
            f"dataset {name!r} not found under run-config 'data-dir' = {data_dir!r}: the files torchvision's "
            f"{cls_name} reads are missing there; nothing is downloaded, put them there first"
        ) from None
    data = ds.data
    data = data.numpy() if hasattr(data, "numpy") else np.asarray(data)
    x = data.astype(np.float32) / 255.0
    if x.ndim == 3:  # N, H, W (MNIST family)
        x = x[:, None, :, :]
    else:  # N, H, W, C (CIFAR)
        x = np.transpose(x, (0, 3, 1, 2))
    m = np.asarray(mean, dtype=np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, dtype=np.float32).reshape(1, -1, 1, 1)
    x = np.ascontiguousarray((x - m) / s, dtype=np.float32)
    targets = ds.targets
    y = np.asarray(targets.numpy() if hasattr(targets, "numpy") else targets, dtype=np.int64)
    return ArrayDataset(x, y, len(ds.classes))


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


@functools.lru_cache(maxsize=4)
def load_dataset(name: str, data_dir: str = "") -> tuple[ArrayDataset, ArrayDataset]:
    """Load ``(train, test)`` for dataset ``name`` (cached)."""
    if name == "digits":
        return load_digits_dataset()
    if name in _TORCHVISION:
        if not data_dir:
            raise ConfigError(f"dataset {name!r} needs run-config 'data-dir'")
        return _torchvision_arrays(name, data_dir, True), _torchvision_arrays(name, data_dir, False)
    if name == "a9a":
        train_path, test_path = _a9a_paths(data_dir)
        return read_libsvm(train_path), read_libsvm(test_path)
    if name.startswith("hf:"):  # a Hugging Face dataset (fedapp.hf_data documents the syntax)
        from fedapp.hf_data import load_hf

        train, test = load_hf(name, data_dir)
        return ArrayDataset(*train), ArrayDataset(*test)
    raise ConfigError(f"unknown dataset {name!r}; valid: digits, mnist, fmnist, cifar10, cifar100, a9a, hf:<name>")
