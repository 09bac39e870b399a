"""A SuperNode's own data: run-config ``dataset = "node-local"`` and node-config ``data-path``.

Each node reads the file or folder its node-config ``data-path`` names, on its own machine; nothing of it leaves the
node but what every client reply carries (N_i, the update, its metrics). Formats, by what the path is:

* ``*.npz``: arrays ``x`` (N × ...) and ``y`` (N integer labels), read with ``allow_pickle=False``;
* ``*.csv`` / ``*.parquet``: one row per example, the label in column ``label`` (or node-config ``label-column``),
  every other column a numeric feature;
* a folder written by Hugging Face ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` whose splits are pooled):
  the label column as above, the inputs an image/array column or the numeric columns (:mod:`fedapp.data.hf_data`);
* any other folder: an image folder, one subfolder per class holding image files. Subfolders named by integers are
  those labels; otherwise the sorted subfolder names are classes 0..k−1 and every node needs all k of them.

Inputs become float32: the values of a .npz, CSV or Parquet as stored; images (an image folder, an image column) scaled
by 1/255, channels first. The node does no standardization of its own: per-node statistics would give each node a
different input scale.

The server cannot see this data, so the run-config states the schema it builds the model from: ``input-shape``
(e.g. ``[16]`` or ``[1, 28, 28]``) and ``num-classes``. Each node checks its data against it at first use
(:func:`node_splits`): inputs of that shape (a flat row of the same size is reshaped to it), labels in
0..num-classes−1, at least one example; a mismatch is a :class:`NodeDataError` naming the node-config key, which the
client answers with a refusal (the run goes on with the other nodes). The node then splits its examples into local
train / validation / test by the run's seed (``local-test-fraction``, ``validation-fraction``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedapp.config import ConfigError, DataConfig
from fedapp.config.keys import NODE_LOCAL, parse_input_shape

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


class NodeDataError(ConfigError):
    """This node's data cannot serve the run; the message names the node-config key and the mismatch."""


@dataclass(frozen=True)
class DataSchema:
    """What the server builds the model from when it cannot see the data: run-config ``input-shape`` and
    ``num-classes``."""

    input_shape: tuple[int, ...]
    num_classes: int


def is_node_local(data: DataConfig) -> bool:
    return data.dataset == NODE_LOCAL


def run_schema(data: DataConfig) -> DataSchema:
    """The schema of a node-local run (``ConfigError`` naming the missing key)."""
    shape = parse_input_shape(data.input_shape)
    if not shape or data.num_classes < 2:
        missing = [k for k, bad in (("input-shape", not shape), ("num-classes", data.num_classes < 2)) if bad]
        raise ConfigError(f"run-config 'dataset' = {NODE_LOCAL!r} needs {' and '.join(repr(k) for k in missing)}: "
                          "the server builds the model from them, since it never sees the nodes' data (e.g. "
                          "input-shape=[16] num-classes=3)")
    return DataSchema(shape, int(data.num_classes))


def run_shape(data: DataConfig) -> tuple[tuple[int, ...], int]:
    """(input shape, classes) the run's model is built for: run-config ``input-shape`` and ``num-classes`` when the
    data is node-local (the server never sees it), else the dataset's."""
    if is_node_local(data):
        schema = run_schema(data)
        return schema.input_shape, schema.num_classes
    from fedapp.data.datasets import load_dataset

    _, test = load_dataset(data.dataset, data.data_dir)
    return test.input_shape, test.num_classes


# ----------------------------------------------------------------------------- readers
def _npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with np.load(path, allow_pickle=False) as arrays:
        missing = [k for k in ("x", "y") if k not in arrays.files]
        if missing:
            raise ValueError(f"the .npz holds arrays {sorted(arrays.files)}, not 'x' and 'y'")
        return np.asarray(arrays["x"]), np.asarray(arrays["y"])


def _table(path: Path, label_column: str) -> tuple[np.ndarray, np.ndarray]:
    import pandas as pd  # type: ignore[import-untyped]

    frame = pd.read_csv(path) if path.suffix.lower() == ".csv" else pd.read_parquet(path)
    if label_column not in frame.columns:
        raise ValueError(f"it has no label column {label_column!r} (columns: {list(frame.columns)[:12]}); name it "
                         "with node-config 'label-column'")
    features = frame.drop(columns=[label_column])
    text = [str(c) for c in features.columns if not pd.api.types.is_numeric_dtype(features[c])]
    if text or features.shape[1] == 0:
        raise ValueError(f"feature columns must be numeric; not numeric: {text[:8]}" if text else
                         "it has no feature column besides the label")
    return features.to_numpy(dtype=np.float64), frame[label_column].to_numpy()


def _saved_hf(path: Path, label_column: str) -> tuple[np.ndarray, np.ndarray]:
    import datasets

    from fedapp.data.hf_data import _feature_columns, _features, _images, _label_column

    data = datasets.load_from_disk(str(path))
    ds = datasets.concatenate_datasets(list(data.values())) if isinstance(data, datasets.DatasetDict) else data
    source = str(path)
    label = _label_column(ds, label_column, source)
    x, image = _features(ds, _feature_columns(ds, None, label, source), source)
    if image or x.ndim in (3, 4):
        x = _images(x)
    return x, np.asarray(ds[label])


def _image_folder(path: Path, channels: int | None) -> tuple[np.ndarray, np.ndarray, int | None]:
    """(x, y, the number of named classes: None when the subfolders are numbers, which are the labels)."""
    from PIL import Image

    classes = sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise ValueError("it is a folder, but neither a Hugging Face save_to_disk folder nor an image folder (one "
                         "subfolder per class)")
    numbered = all(c.isdigit() for c in classes)
    mode = {1: "L", 3: "RGB", 4: "RGBA"}.get(channels or 0, "RGB")
    images, labels = [], []
    for index, name in enumerate(classes):
        for file in sorted((path / name).iterdir()):
            if file.suffix.lower() in IMAGE_SUFFIXES:
                with Image.open(file) as img:
                    images.append(np.asarray(img.convert(mode)))
                labels.append(int(name) if numbered else index)
    if not images:
        raise ValueError(f"its class subfolders {classes[:8]} hold no image files ({', '.join(IMAGE_SUFFIXES)})")
    sizes = {a.shape for a in images}
    if len(sizes) > 1:
        raise ValueError(f"its images differ in size ({sorted(sizes)[:4]}); resize them to one size first")
    x = np.stack(images).astype(np.float32) / 255.0
    x = x[:, None] if x.ndim == 3 else np.transpose(x, (0, 3, 1, 2))
    return x, np.asarray(labels, dtype=np.int64), None if numbered else len(classes)


def _read(path: Path, label_column: str, channels: int | None) -> tuple[np.ndarray, np.ndarray, int | None]:
    """(x, y, classes the folder names, when it is a folder of named classes)."""
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            return (*_saved_hf(path, label_column), None)
        return _image_folder(path, channels)
    suffix = path.suffix.lower()
    if suffix == ".npz":
        return (*_npz(path), None)
    if suffix in (".csv", ".parquet"):
        return (*_table(path, label_column), None)
    raise ValueError("its format is not known: expected a .npz, .csv or .parquet file, a Hugging Face save_to_disk "
                     "folder or an image folder")


@functools.lru_cache(maxsize=4)
def _load(path: str, label_column: str, channels: int | None, stamp: tuple[float, int]) -> tuple[np.ndarray, ...]:
    x, y, named = _read(Path(path), label_column, channels)
    return x, y, np.asarray([-1 if named is None else named])


def _stamp(path: Path) -> tuple[float, int]:
    st = path.stat()
    return st.st_mtime, st.st_size


# ----------------------------------------------------------------------------- checks and splits
def node_arrays(node_config: Mapping[str, Any], schema: DataSchema) -> tuple[np.ndarray, np.ndarray]:
    """(x float32 N × input-shape, y int64 N) of this node's ``data-path``, checked against ``schema``."""
    if "data-path" not in node_config or not str(node_config["data-path"]).strip():
        raise NodeDataError(f"node-config 'data-path' is not set: run-config 'dataset' = {NODE_LOCAL!r} trains every "
                            "node on its own data, named by its node-config 'data-path'")
    raw = str(node_config["data-path"])
    label_column = str(node_config.get("label-column", "label")) or "label"
    where = f"node-config 'data-path' = {raw!r}"
    path = Path(os.path.expanduser(raw))
    if not path.exists():
        raise NodeDataError(f"{where}: no such file or folder on this node")
    channels = schema.input_shape[0] if len(schema.input_shape) == 3 else 1 if len(schema.input_shape) == 2 else None
    try:
        x, y, named = _load(str(path.resolve()), label_column, channels, _stamp(path))
    except (ValueError, OSError, ConfigError, KeyError, TypeError) as exc:  # the message names label-column if it is it
        raise NodeDataError(f"{where}: cannot be read: {exc}") from None
    return _checked(x, y, int(named[0]), schema, where)


def _checked(x: np.ndarray, y: np.ndarray, named_classes: int, schema: DataSchema,
             where: str) -> tuple[np.ndarray, np.ndarray]:
    if len(x) == 0 or len(x) != len(y) or y.ndim != 1:
        raise NodeDataError(f"{where}: expected N > 0 examples with one label each, got inputs {x.shape} and labels "
                            f"{y.shape}")
    shape, size = schema.input_shape, int(np.prod(schema.input_shape))
    if tuple(x.shape[1:]) != shape:
        if int(np.prod(x.shape[1:])) != size:
            raise NodeDataError(f"{where}: its inputs have shape {tuple(x.shape[1:])}, but run-config 'input-shape' "
                                f"is {list(shape)} ({size} values per example)")
        x = x.reshape((len(x), *shape))
    if not np.issubdtype(x.dtype, np.number) or not np.all(np.isfinite(x.astype(np.float64))):
        raise NodeDataError(f"{where}: its inputs are not all finite numbers")
    if named_classes > 0 and named_classes != schema.num_classes:
        raise NodeDataError(f"{where}: its {named_classes} class subfolders do not match run-config 'num-classes' = "
                            f"{schema.num_classes}; name the subfolders 0..{schema.num_classes - 1} when a node holds "
                            "only some classes")
    if not np.issubdtype(y.dtype, np.number) or not np.all(np.equal(np.mod(y, 1), 0)):
        raise NodeDataError(f"{where}: its labels must be integers 0..{schema.num_classes - 1} (found {y[:3]!r}...)")
    low, high = int(np.min(y)), int(np.max(y))
    if low < 0 or high >= schema.num_classes:
        raise NodeDataError(f"{where}: its labels span {low}..{high}, outside 0..{schema.num_classes - 1} of run-config "
                            f"'num-classes' = {schema.num_classes}")
    return np.ascontiguousarray(x, dtype=np.float32), y.astype(np.int64)


def node_splits(node_config: Mapping[str, Any], data: DataConfig, seed: int, client_id: int):
    """(local train, local validation, local test) :class:`fedapp.data.datasets.ArrayDataset` s of this node's data,
    split by the run's seed as a partition is (:func:`fedapp.data.client_data.split_client_indices`)."""
    from fedapp.data.client_data import split_client_indices
    from fedapp.data.datasets import ArrayDataset

    schema = run_schema(data)
    x, y = node_arrays(node_config, schema)
    tr, val, te = split_client_indices(np.arange(len(y)), data.local_test_fraction, data.validation_fraction, seed,
                                       client_id)
    if len(tr) == 0:
        raise NodeDataError(f"node-config 'data-path' = {str(node_config['data-path'])!r}: its {len(y)} examples leave "
                            "none to train on after the local test and validation splits")
    return tuple(ArrayDataset(x[idx], y[idx], schema.num_classes) for idx in (tr, val, te))

