"""A user's own dataset in simulation: run-config ``dataset = "module.path:loader"``.

``loader()`` returns ``(train, test)``, each either a pair of arrays ``(x, y)`` or a ``torch.utils.data.Dataset`` of
``(x, y)`` items (integer labels 0..k−1). They become the run's pools as the named datasets do (``x`` float32, ``y``
int64, k = the largest label + 1), and the same partitioners split the training pool among the clients. The module
is imported like a user model (:mod:`fedapp.models.user`): from the launch folder, the app folder ``flwr run`` ships,
or an installed package. Every problem is a ``ConfigError`` naming run-config 'dataset'.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedapp.config import ConfigError
from fedapp.models.user import load_factory


def _arrays(part: Any, which: str, spec: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of one returned part: a pair of array-likes, or a torch ``Dataset`` of (x, y) items."""
    if isinstance(part, tuple) and len(part) == 2:
        x, y = part
    else:
        try:
            import torch

            if not isinstance(part, torch.utils.data.Dataset):
                raise TypeError
            items = [part[i] for i in range(len(part))]  # type: ignore[arg-type]
        except (TypeError, AttributeError):
            raise ConfigError(f"run-config 'dataset' = {spec!r}: its {which} part is a {type(part).__name__}, not "
                              "(x, y) arrays or a torch Dataset of (x, y) items") from None
        if not items:
            raise ConfigError(f"run-config 'dataset' = {spec!r}: its {which} part is empty")
        x = np.stack([np.asarray(item[0]) for item in items])
        y = np.asarray([int(np.asarray(item[1])) for item in items])
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y) or len(x) == 0:
        raise ConfigError(f"run-config 'dataset' = {spec!r}: its {which} part has x of shape {x.shape} and y of shape "
                          f"{y.shape}; expected x [N, ...] and y [N] with N > 0")
    if not np.issubdtype(y.dtype, np.integer) and not np.all(np.equal(np.mod(y, 1), 0)):
        raise ConfigError(f"run-config 'dataset' = {spec!r}: its {which} labels are not integers")
    if not np.all(np.isfinite(x.astype(np.float64))):
        raise ConfigError(f"run-config 'dataset' = {spec!r}: its {which} inputs hold NaN or infinite values")
    return x.astype(np.float32), y.astype(np.int64)


UserArrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]


def load_user_arrays(spec: str) -> UserArrays:
    """(train x, train y, test x, test y, classes) of the user's loader ``spec``, checked
    (``fedapp.data.datasets.load_dataset`` makes them the run's pools)."""
    try:
        loader = load_factory(spec)
    except ValueError as exc:
        raise ConfigError(f"run-config 'dataset' = {spec!r}: {exc}") from None
    try:
        out = loader()
    except Exception as exc:  # noqa: BLE001 — the loader is the user's code
        raise ConfigError(f"run-config 'dataset' = {spec!r}: the loader raised {type(exc).__name__}: {exc}") from None
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ConfigError(f"run-config 'dataset' = {spec!r}: the loader must return (train, test), got "
                          f"{type(out).__name__}")
    (tx, ty), (vx, vy) = _arrays(out[0], "train", spec), _arrays(out[1], "test", spec)
    if tx.shape[1:] != vx.shape[1:]:
        raise ConfigError(f"run-config 'dataset' = {spec!r}: train inputs have shape {tx.shape[1:]}, test inputs "
                          f"{vx.shape[1:]}")
    labels = np.concatenate([ty, vy])
    if labels.min() < 0:
        raise ConfigError(f"run-config 'dataset' = {spec!r}: labels must be 0..k-1, found {int(labels.min())}")
    classes = int(labels.max()) + 1
    if classes < 2:
        raise ConfigError(f"run-config 'dataset' = {spec!r}: needs at least 2 classes, found {classes}")
    return tx, ty, vx, vy, classes
