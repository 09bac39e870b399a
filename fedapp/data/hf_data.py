"""Hugging Face datasets as arrays: run-config ``dataset = 'hf:<source>[?option=value&...]'``.

``<source>`` is, in this order:

1. a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (read offline with
   ``datasets.load_from_disk``), given absolute, relative to the working folder, or relative to
   run-config ``data-dir``;
2. any other local folder ``datasets.load_dataset`` reads (parquet/CSV/image folders);
3. a Hub dataset name, the same name flwr-datasets' ``FederatedDataset(dataset=...)`` takes
   (e.g. ``ylecun/mnist``), loaded with ``datasets.load_dataset``: the first run needs internet,
   the files are cached in ``data-dir`` when set (else Hugging Face's default cache), and later
   runs read that cache (set ``HF_DATASETS_OFFLINE=1`` to forbid any network access).

Options: ``subset`` (the Hub configuration name), ``train`` (split, default ``train``), ``test``
(split, default ``test``; when the dataset has no such split and none was named, a fixed stratified
20 % of ``train`` is held out), ``features`` (column, default ``image``/``img``/``pixel_values``,
else every numeric column but the label), ``label`` (column, default ``label``, else the only
``ClassLabel`` column). Image columns and 2-D/3-D array columns become float32 N × C × H × W
(integer pixels scaled by 1/255), standardized per channel with the train split's mean and std;
scalar and 1-D numeric columns are kept as float32 features.
This module returns plain arrays; ``fedapp.data.datasets`` wraps them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

import numpy as np

from fedapp.config import ConfigError

if TYPE_CHECKING:
    import datasets

PREFIX = "hf:"
OPTIONS = ("subset", "train", "test", "features", "label")
IMAGE_COLUMNS = ("image", "img", "pixel_values")
HOLDOUT_FRACTION = 0.2
_NUMERIC = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
            "float16", "float32", "float64"}

Arrays = tuple[np.ndarray, np.ndarray, int]  # x (float32), y (int64), num_classes


def parse_spec(name: str) -> tuple[str, dict[str, str]]:
    """``'hf:<source>?k=v&...'`` → (source, options); rejects unknown options."""
    if not name.startswith(PREFIX) or len(name) == len(PREFIX):
        raise ConfigError(f"dataset {name!r}: expected 'hf:<name or folder>[?option=value&...]'")
    source, _, query = name[len(PREFIX):].partition("?")
    options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=False))
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown or not source:
        raise ConfigError(f"dataset {name!r}: unknown option(s) {unknown} (valid: {', '.join(OPTIONS)})"
                          if unknown else f"dataset {name!r} names no dataset")
    return source, options


def _local_folder(source: str, data_dir: str) -> Path | None:
    for base in ([Path(data_dir)] if data_dir else []) + [Path.cwd()]:
        path = (base / source).expanduser()
        if path.is_dir():
            return path
    return None


def _open(source: str, options: dict[str, str], data_dir: str) -> datasets.DatasetDict | datasets.Dataset:
    import datasets

    folder = _local_folder(source, data_dir)
    try:
        if folder is not None and ((folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()):
            return datasets.load_from_disk(str(folder))
        return datasets.load_dataset(str(folder) if folder else source, options.get("subset") or None,
                                     cache_dir=None if folder or not data_dir else data_dir)
    except Exception as exc:  # noqa: BLE001 — not found, offline, bad format: all one config error
        raise ConfigError(f"dataset 'hf:{source}' could not be loaded ({type(exc).__name__}: {exc}); a Hub name "
                          "needs internet on first use, a local folder must be a save_to_disk output or data files"
                          ) from None


def _split(data: Any, name: str, source: str) -> datasets.Dataset:
    if name not in data:
        raise ConfigError(f"dataset 'hf:{source}' has no split {name!r}; splits: {sorted(data)}")
    return data[name]


def _label_column(ds: datasets.Dataset, wanted: str | None, source: str) -> str:
    from datasets import ClassLabel

    if wanted:
        if wanted not in ds.column_names:
            raise ConfigError(f"dataset 'hf:{source}' has no column {wanted!r}; columns: {ds.column_names}")
        return wanted
    if "label" in ds.column_names:
        return "label"
    class_labels = [c for c, f in ds.features.items() if isinstance(f, ClassLabel)]
    if len(class_labels) == 1:
        return class_labels[0]
    raise ConfigError(f"dataset 'hf:{source}': which column is the label? add '?label=<column>' "
                      f"(columns: {ds.column_names})")


def _feature_columns(ds: datasets.Dataset, wanted: str | None, label: str, source: str) -> list[str]:
    if wanted:
        if wanted not in ds.column_names:
            raise ConfigError(f"dataset 'hf:{source}' has no column {wanted!r}; columns: {ds.column_names}")
        return [wanted]
    for col in IMAGE_COLUMNS:
        if col in ds.column_names:
            return [col]
    rest = [c for c in ds.column_names if c != label]
    numeric = [c for c in rest if getattr(ds.features[c], "dtype", "") in _NUMERIC]
    if len(rest) == 1 or (rest and numeric == rest):
        return rest
    raise ConfigError(f"dataset 'hf:{source}': which column holds the inputs? add '?features=<column>' "
                      f"(columns: {ds.column_names})")


def _features(ds: datasets.Dataset, columns: list[str], source: str) -> tuple[np.ndarray, bool]:
    """(features, is_image) of ``ds``: one column as is, several numeric columns side by side."""
    from datasets import Image

    numpy_ds = ds.with_format("numpy")
    try:
        if len(columns) > 1:
            return np.stack([np.asarray(numpy_ds[c], dtype=np.float32) for c in columns], axis=1), False
        return np.asarray(numpy_ds[columns[0]]), isinstance(ds.features[columns[0]], Image)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"dataset 'hf:{source}': column(s) {columns} are not arrays of one shape: {exc}") from None


def _images(x: np.ndarray) -> np.ndarray:
    """N × H × W, N × H × W × C or N × C × H × W (integers taken as 8-bit) → float32 N × C × H × W."""
    x = x.astype(np.float32) / (255.0 if np.issubdtype(x.dtype, np.integer) else 1.0)
    if x.ndim == 3:
        return x[:, None]
    channels_last = x.shape[-1] <= 4 < x.shape[1]
    return np.transpose(x, (0, 3, 1, 2)) if channels_last else x


def _labels(train: datasets.Dataset, test: datasets.Dataset, column: str) -> tuple[np.ndarray, np.ndarray, int]:
    from datasets import ClassLabel

    y_train, y_test = np.asarray(train[column]), np.asarray(test[column])
    feature = train.features[column]
    if isinstance(feature, ClassLabel):
        return y_train.astype(np.int64), y_test.astype(np.int64), int(feature.num_classes)
    classes = np.unique(np.concatenate([y_train, y_test]))
    if np.issubdtype(classes.dtype, np.integer) and classes.min() >= 0:
        return y_train.astype(np.int64), y_test.astype(np.int64), int(classes.max()) + 1
    return np.searchsorted(classes, y_train), np.searchsorted(classes, y_test), len(classes)


def _train_test(data: Any, options: dict[str, str], source: str) -> tuple[datasets.Dataset, datasets.Dataset]:
    import datasets

    if isinstance(data, datasets.Dataset):
        data = datasets.DatasetDict(train=data)
    train = _split(data, options.get("train") or "train", source)
    test_name = options.get("test")
    if test_name or "test" in data:
        return train, _split(data, test_name or "test", source)
    from sklearn.model_selection import train_test_split

    label = _label_column(train, options.get("label"), source)
    labels = np.asarray(train[label])
    idx_train, idx_test = train_test_split(np.arange(len(train)), test_size=HOLDOUT_FRACTION, random_state=0,
                                           stratify=labels if np.unique(labels, return_counts=True)[1].min() > 1 else None)
    return train.select(np.sort(idx_train)), train.select(np.sort(idx_test))


def load_hf(name: str, data_dir: str = "") -> tuple[Arrays, Arrays]:
    """``((x_train, y_train, C), (x_test, y_test, C))`` of run-config dataset ``name`` = ``'hf:...'``."""
    source, options = parse_spec(name)
    train, test = _train_test(_open(source, options, data_dir), options, source)
    label = _label_column(train, options.get("label"), source)
    columns = _feature_columns(train, options.get("features"), label, source)
    (x_train, image), (x_test, _) = _features(train, columns, source), _features(test, columns, source)
    y_train, y_test, num_classes = _labels(train, test, label)
    if image or x_train.ndim in (3, 4):  # images (or raw pixel arrays): channels first, standardized
        x_train, x_test = _images(x_train), _images(x_test)
        mean = x_train.mean(axis=(0, 2, 3), keepdims=True)
        std = x_train.std(axis=(0, 2, 3), keepdims=True) + 1e-8
        x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    return ((np.ascontiguousarray(x_train, dtype=np.float32), y_train, num_classes),
            (np.ascontiguousarray(x_test, dtype=np.float32), y_test, num_classes))
