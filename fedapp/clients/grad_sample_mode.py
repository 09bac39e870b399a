"""``grad-sample-mode = "auto"``: the fastest Opacus per-sample-gradient mode for this model, batch and device.

Every mode a model supports computes the same clipped, noised gradient (``tests/unit/fedapp/models/test_dp_models.py``
checks each against per-sample clipping done one sample at a time), so the choice only affects
speed; which is fastest depends on the model's layers, the batch size and the device (measured in
docs/benchmarks.md: ``ew`` for the CIFAR CNN on CPU, ``functorch`` for the MNIST CNN). "auto" times
a few real DP-SGD steps (:func:`fedapp.clients.training.local_train`) in each supported mode on synthetic
data of the run's shapes and keeps the fastest: once per process, and across processes and runs
through the shared cache (:mod:`fedapp.state.cache`), keyed by model, shapes, batch size, device and
library versions. Processes that start together (a sweep's parallel cells, a simulation's actors) take the entry's
lock in turn: the first measures, the others read its choice, so every process sharing the cache trains in one mode
(the modes agree to float rounding, not bit for bit).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from fedapp.data.datasets import ArrayDataset
from fedapp.models.catalog import GRAD_SAMPLE_MODES, UNSUPPORTED_GRAD_SAMPLE_MODES

AUTO = "auto"


def supported_modes(model_name: str) -> tuple[str, ...]:
    """The modes to try: every one for a user's model (:func:`time_modes` keeps those that run), else the catalog's."""
    return tuple(m for m in GRAD_SAMPLE_MODES if (model_name, m) not in UNSUPPORTED_GRAD_SAMPLE_MODES)


def time_modes(new_model: Callable[[], nn.Module], input_shape: tuple[int, ...], num_classes: int,
               batch_size: int, device: torch.device, modes: tuple[str, ...], steps: int = 4,
               repeats: int = 2) -> dict[str, float]:
    """Seconds per DP-SGD step of each mode: the best of ``repeats`` timed runs of ``steps`` steps
    (after one untimed warm-up run), on synthetic data of the run's shapes."""
    from fedapp.clients.training import LocalTraining, PerSampleDP, local_train

    rng = np.random.default_rng(0)
    n = batch_size * steps  # Poisson rate 1/steps: about `batch_size` samples a step
    data = ArrayDataset(rng.standard_normal((n, *input_shape)).astype(np.float32),
                        rng.integers(0, num_classes, n).astype(np.int64), num_classes)
    base = new_model()
    out: dict[str, float] = {}
    for mode in modes:
        spec = LocalTraining(batch_size=batch_size, steps=steps, lr=0.0, seed=1, dp=PerSampleDP(1.0, 1.0, mode))
        best = float("inf")
        for rep in range(repeats + 1):
            model = copy.deepcopy(base)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            result = local_train(model, data, spec, device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if rep:  # the first run warms up kernels and Opacus' hooks
                best = min(best, (time.perf_counter() - start) / max(result.steps, 1))
        out[mode] = best
    return out


def time_modes_that_run(new_model: Callable[[], nn.Module], input_shape: tuple[int, ...], num_classes: int,
                        batch_size: int, device: torch.device, modes: tuple[str, ...]) -> dict[str, float]:
    """:func:`time_modes` of ``modes``; when one of them fails on this model (a user's model may not run under every
    per-sample-gradient mode), each mode alone, leaving out those that fail; ``hooks`` at an infinite time when none
    runs, so it is the fallback and its own error shows in training."""
    try:
        return time_modes(new_model, input_shape, num_classes, batch_size, device, modes)
    except Exception:  # noqa: BLE001 — some mode does not run here: find which
        pass
    out: dict[str, float] = {}
    for mode in modes:
        try:
            out.update(time_modes(new_model, input_shape, num_classes, batch_size, device, (mode,)))
        except Exception:  # noqa: BLE001 — a mode this model does not support: not a candidate
            continue
    return out or {"hooks": float("inf")}


def _versions() -> str:
    from importlib.metadata import version

    return f"torch=={torch.__version__},opacus=={version('opacus')}"


_CHOSEN: dict[str, str] = {}  # per-process memo


def resolve_grad_sample_mode(mode: str, model_name: str, new_model: Callable[[], nn.Module], data: ArrayDataset,
                             batch_size: int, device: torch.device) -> str:
    """``mode`` itself, or for ``auto`` the fastest supported mode measured for this model/batch/device."""
    if mode != AUTO:
        return mode
    from fedapp.state.cache import entry_lock, lookup, store

    modes = supported_modes(model_name)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    fields = {"model": model_name, "input_shape": list(data.input_shape), "num_classes": int(data.num_classes),
              "batch_size": int(batch_size), "device": label, "libraries": _versions(), "modes": list(modes)}
    memo_key = json.dumps(fields, sort_keys=True)
    if memo_key in _CHOSEN:
        return _CHOSEN[memo_key]
    with entry_lock("grad-sample-modes", fields):  # processes starting together measure once and share the choice
        chosen = lookup("grad-sample-modes", fields)
        if chosen not in modes:
            times = time_modes_that_run(new_model, tuple(data.input_shape), int(data.num_classes), int(batch_size),
                                        device, modes)
            chosen = min(times, key=times.__getitem__)
            store("grad-sample-modes", fields, chosen)
    _CHOSEN[memo_key] = str(chosen)
    return str(chosen)
