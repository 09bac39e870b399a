"""Import torchvision on a CPU-only torch whose torchvision wheel is a CUDA build.

PyPI's ``torchvision==0.28.0`` wheel ships a CUDA-linked ``_C`` extension. On a CPU
build of ``torch`` that extension fails to load, and ``torchvision/_meta_registrations``
then calls ``torch.library.register_fake("torchvision::nms")`` (and ``qnms``) on an
operator that was never defined, so ``import torchvision`` dies with
``RuntimeError: operator torchvision::nms does not exist``.

:func:`ensure_torchvision_importable` defines the *schemas* of exactly those missing
operators, and only when the extension really failed to load. No kernel is registered:
calling ``torchvision.ops.nms`` still raises, as it should without the extension; the
dataset and transform code this project uses never touches those ops.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

# Operators whose fake kernels torchvision registers without checking that the
# extension loaded (torchvision 0.28 ``_meta_registrations.py``).
UNGUARDED_OP_SCHEMAS: dict[str, str] = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}

_LIBRARY: torch.library.Library | None = None  # kept alive: schemas live as long as it does
_STATE: dict[str, object] = {"checked": False, "extension_loaded": None, "defined": []}


def _extension_path() -> Path | None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    for candidate in sorted(folder.glob("_C*.so")) + sorted(folder.glob("_C*.pyd")):
        return candidate
    return None


def _op_exists(name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def torchvision_extension_loads() -> bool:
    """True when torchvision's compiled ``_C`` extension loads into this torch."""
    path = _extension_path()
    if path is None:
        return False
    try:
        torch.ops.load_library(str(path))
        return True
    except (OSError, RuntimeError, ImportError):
        return False


def ensure_torchvision_importable() -> list[str]:
    """Define the missing torchvision op schemas if (and only if) ``_C`` cannot load.

    Returns the names of the schemas defined by this call (empty when nothing was needed).
    Idempotent; safe to call before or after ``import torchvision``.
    """
    global _LIBRARY
    if _STATE["checked"]:
        return []
    _STATE["checked"] = True
    if importlib.util.find_spec("torchvision") is None:
        return []
    loaded = torchvision_extension_loads()
    _STATE["extension_loaded"] = loaded
    if loaded or os.environ.get("DPFL_DISABLE_TORCHVISION_GUARD") == "1":
        return []
    missing = [name for name in UNGUARDED_OP_SCHEMAS if not _op_exists(name)]
    if not missing:
        return []
    _LIBRARY = torch.library.Library("torchvision", "FRAGMENT")  # noqa: TID251
    for name in missing:
        _LIBRARY.define(UNGUARDED_OP_SCHEMAS[name])
    _STATE["defined"] = list(missing)
    return list(missing)


def guard_state() -> dict[str, object]:
    """What the guard found and did (for tests and ``config.json``)."""
    return dict(_STATE)


def import_torchvision():
    """``import torchvision`` behind the guard; returns the module."""
    ensure_torchvision_importable()
    import torchvision

    return torchvision
