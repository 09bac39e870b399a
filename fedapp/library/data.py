"""A user's data as the arrays the project's local-training loop reads (:class:`~fedapp.data.datasets.ArrayDataset`).

DP-SGD's accounting needs Poisson-sampled batches (each record joins each step with probability q = 1/⌈N/b⌉), so a
user's ``DataLoader`` contributes its dataset and its batch size b, never its sampler or shuffling: the records are
read once into memory and :func:`fedapp.clients.training.local_train` draws the batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from fedapp.data.datasets import ArrayDataset

#: what a user may hand over as a split: a ``DataLoader``, a map-style ``Dataset`` of (x, y) items, or (x, y) arrays
UserData = DataLoader | Dataset | tuple[Any, Any]


class DataProblem(ValueError):
    """A user's split cannot be read as (x, y) records; the message says which split and what is wrong."""


def loader_batch_size(data: UserData) -> int | None:
    """The batch size of a ``DataLoader`` (None for anything else, or a loader built with ``batch_size=None``)."""
    if isinstance(data, DataLoader) and data.batch_size is not None:
        return int(data.batch_size)
    return None


def as_array_dataset(data: UserData, which: str, num_classes: int | None = None) -> ArrayDataset:
    """``data`` as an :class:`ArrayDataset`: inputs float32, integer labels int64 (other labels float32).

    ``num_classes`` (None: the largest integer label + 1, 0 for non-integer labels) is recorded on the result.
    Raises :class:`DataProblem` naming ``which`` split when the records are not (x, y) pairs of one shape."""
    if isinstance(data, DataLoader):
        data = data.dataset
    if isinstance(data, tuple) and len(data) == 2 and not isinstance(data, Dataset):
        x, y = np.asarray(_numpy(data[0])), np.asarray(_numpy(data[1]))
    elif isinstance(data, Dataset):
        try:
            n = len(data)  # type: ignore[arg-type]
        except TypeError:
            raise DataProblem(f"the {which} data is an iterable Dataset without a length; pass a map-style Dataset "
                              "(DP-SGD samples records by index)") from None
        items = [data[i] for i in range(n)]
        bad = next((i for i, item in enumerate(items) if not (isinstance(item, (tuple, list)) and len(item) == 2)),
                   None)
        if bad is not None:
            raise DataProblem(f"item {bad} of the {which} data is a {type(items[bad]).__name__}, not an (x, y) pair")
        try:
            x = np.stack([np.asarray(_numpy(item[0])) for item in items]) if items else np.zeros((0, 1))
        except ValueError as exc:
            raise DataProblem(f"the {which} inputs do not share one shape ({exc})") from None
        y = np.asarray([np.asarray(_numpy(item[1])) for item in items])
    else:
        raise DataProblem(f"the {which} data is a {type(data).__name__}; expected a DataLoader, a map-style Dataset "
                          "of (x, y) items or a pair of arrays (x, y)")
    if len(x) == 0 or x.ndim < 2 or y.ndim != 1 or len(x) != len(y):
        raise DataProblem(f"the {which} data has inputs of shape {x.shape} and labels of shape {y.shape}; expected "
                          "[N, ...] inputs and [N] scalar labels with N > 0")
    integer = np.issubdtype(y.dtype, np.integer)
    labels = y.astype(np.int64) if integer else y.astype(np.float32)
    if num_classes is None:
        num_classes = int(labels.max()) + 1 if integer else 0
    return ArrayDataset(np.ascontiguousarray(x, dtype=np.float32), labels, int(num_classes))


def _numpy(value: Any) -> Any:
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
